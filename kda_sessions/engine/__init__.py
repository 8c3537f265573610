"""The engine: scheduler, runner, sampler, pools, snapshot I/O."""
