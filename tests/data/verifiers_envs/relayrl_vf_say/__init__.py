"""A single-turn verifiers 0.4 environment for relayrl's tests: each task asks the model to say
something; a verifiers reward function scores the reply 0.1 per character. It runs in the verifiers
venv (scripts/envs.sh), never in relayrl's: ``PYTHONPATH=tests/data/verifiers_envs`` and the taskset id
``relayrl_vf_say``."""

import verifiers.v1 as vf


class SayData(vf.TaskData):
    pass


class SayTask(vf.Task[SayData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def length(self, trace: vf.Trace) -> float:
        replies = [m for m in trace.messages if m.role == "assistant"]
        return 0.1 * len(replies[-1].content or "") if replies else 0.0


class SayConfig(vf.TasksetConfig):
    num_tasks: int = 4
    task: vf.TaskConfig = vf.TaskConfig()


class SayTaskset(vf.Taskset[SayTask, SayConfig]):
    def load(self) -> list[SayTask]:
        return [
            SayTask(SayData(prompt=f"Say something ({i}).", system_prompt="Be brief."), self.config.task)
            for i in range(self.config.num_tasks)
        ]


__all__ = ["SayTaskset"]
