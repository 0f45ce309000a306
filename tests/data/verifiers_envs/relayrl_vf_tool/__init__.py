"""A tool-using verifiers 0.4 environment for relayrl's tests: the task asks the model to shout a word
with the ``shout`` tool of a ``vf.Toolset`` (served over MCP by verifiers); the reward is 1 when a
tool result in the conversation is the word upper-cased, else 0. It runs in the verifiers venv
(scripts/envs.sh): ``PYTHONPATH=tests/data/verifiers_envs``, taskset id ``relayrl_vf_tool``."""

import verifiers.v1 as vf

from relayrl_vf_tool.shout import ShoutToolset


class ToolData(vf.TaskData):
    word: str


class ToolTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class ToolTask(vf.Task[ToolData, vf.State, ToolTaskConfig]):
    @classmethod
    def toolsets(cls, config: ToolTaskConfig) -> list[vf.Toolset]:
        return [ShoutToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def shouted(self, trace: vf.Trace) -> float:
        results = [str(m.content) for m in trace.messages if m.role == "tool"]
        return 1.0 if any(self.data.word.upper() in r for r in results) else 0.0


class ToolConfig(vf.TasksetConfig):
    task: ToolTaskConfig = ToolTaskConfig()


class ToolTaskset(vf.Taskset[ToolTask, ToolConfig]):
    def load(self) -> list[ToolTask]:
        return [ToolTask(ToolData(prompt="Shout hi.", word="hi"), self.config.task)]


__all__ = ["ToolTaskset"]
