"""The step machinery: scheduler, runner (plan -> run -> postprocess), sampler, state pools, rollback."""
