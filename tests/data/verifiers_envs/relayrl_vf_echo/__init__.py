"""A multi-turn verifiers 0.4 environment for relayrl's tests: the environment plays the user and
echoes each reply back as the next user turn, for ``--env.turns`` turns (3); the episode's reward is
0.1 per character of every reply, recorded by the environment. It runs in the verifiers venv
(scripts/envs.sh): ``PYTHONPATH=tests/data/verifiers_envs``, taskset id ``relayrl_vf_echo``."""

import verifiers.v1 as vf


class EchoData(vf.TaskData):
    pass


class EchoTask(vf.Task[EchoData, vf.State, vf.TaskConfig]):
    pass


class EchoConfig(vf.TasksetConfig):
    num_tasks: int = 2
    task: vf.TaskConfig = vf.TaskConfig()


class EchoTaskset(vf.Taskset[EchoTask, EchoConfig]):
    def load(self) -> list[EchoTask]:
        return [EchoTask(EchoData(prompt=f"Start ({i})."), self.config.task) for i in range(self.config.num_tasks)]


class EchoEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    turns: int = 3


class EchoEnv(vf.Env[EchoEnvConfig]):
    async def run(self, task, agents):
        total = 0.0
        async with agents.agent.interaction(task) as interaction:
            segment = await interaction.turn()
            for turn in range(self.config.turns):
                total += 0.1 * len(segment.last_reply)
                if segment.terminated or turn == self.config.turns - 1:
                    break
                segment = await interaction.turn(segment.last_reply)
        interaction.trace.record_reward("echo", total, 1.0)


__all__ = ["EchoEnv", "EchoTaskset"]
