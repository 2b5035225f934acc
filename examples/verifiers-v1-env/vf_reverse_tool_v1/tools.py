"""The tool server of vf-reverse-tool-v1 (started by verifiers as ``python -m`` this module)."""

import verifiers.v1 as vf


class ReverseToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "reverse_tools"  # the model sees reverse_tools_reverse

    @vf.tool
    def reverse(self, text: str) -> str:
        """Return `text` reversed."""
        return text[::-1]


if __name__ == "__main__":
    ReverseToolset.run()
