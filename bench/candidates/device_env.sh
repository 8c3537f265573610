# Sourced by the device scripts here: a Triton cache in /tmp/tc, unbuffered Python, and the wheels of .whl/train
# (pydantic and the rest, where the device lacks the package's dependencies) installed into /tmp/site.
export TRITON_CACHE_DIR=/tmp/tc PYTHONUNBUFFERED=1
mkdir -p /tmp/tc
if ls .whl/train/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/train/*.whl && export PYTHONPATH=/tmp/site
fi
