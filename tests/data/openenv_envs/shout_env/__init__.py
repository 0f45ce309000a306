"""An OpenEnv MCP environment for relayrl's tests (openenv-core 0.3.0, run in the venv scripts/envs.sh
builds, never in relayrl's): the reset observation asks to shout a word, the environment's one MCP tool
``shout`` upper-cases text, and a call that shouts the word ends the episode with reward 1 (any other
call: reward 0, the episode goes on). ``PYTHONPATH=tests/data/openenv_envs``; the app is
``create_app(ShoutEnv, CallToolAction, CallToolObservation)`` (``python -m shout_env --port PORT``)."""

from uuid import uuid4

from fastmcp import FastMCP
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction
from openenv.core.env_server.types import Observation, State


class ShoutObservation(Observation):
    prompt: str = ""


class ShoutEnv(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True
    WORD = "hi"

    def __init__(self):
        mcp = FastMCP("shout")

        @mcp.tool
        def shout(text: str) -> str:
            """Return the text upper-cased."""
            return text.upper()

        super().__init__(mcp)
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return ShoutObservation(prompt=f"Shout {self.WORD}.", done=False, reward=0.0)

    async def step_async(self, action, timeout_s=None, **kwargs):
        obs = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction):
            self._state.step_count += 1
            shouted = action.tool_name == "shout" and obs.result is not None and obs.result.data == self.WORD.upper()
            obs.reward, obs.done = (1.0 if shouted else 0.0), shouted
        return obs

    def _step_impl(self, action, timeout_s=None, **kwargs):
        raise ValueError(f"only MCP actions (list_tools, call_tool): got {action!r}")

    @property
    def state(self):
        return self._state
