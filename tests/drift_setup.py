"""A Ray worker setup hook that makes every process look like a drifted verl release
before otel_verl activates: one hooked method removed, one with a changed signature."""


def setup() -> None:
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    if "_call_tool" in vars(ToolAgentLoop):
        del ToolAgentLoop._call_tool  # unused by the single-turn agent this run uses
    original = RayPPOTrainer._compute_ref_log_prob
    if not getattr(original, "_drifted", False):

        def _compute_ref_log_prob(self, data):  # the parameter was called `batch`
            return original(self, data)

        # no functools.wraps: its __wrapped__ would make inspect report the old signature
        _compute_ref_log_prob.__qualname__ = "RayPPOTrainer._compute_ref_log_prob"
        _compute_ref_log_prob._drifted = True
        RayPPOTrainer._compute_ref_log_prob = _compute_ref_log_prob

    from otel_verl import activation

    activation.worker_setup()
