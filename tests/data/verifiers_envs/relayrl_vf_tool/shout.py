"""The ``shout`` tool server (verifiers runs it as ``python -m relayrl_vf_tool.shout``, an MCP server)."""

import verifiers.v1 as vf


class ShoutToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = ""

    @vf.tool
    def shout(self, text: str) -> str:
        """Return the text upper-cased."""
        return text.upper()


if __name__ == "__main__":
    ShoutToolset.run()
