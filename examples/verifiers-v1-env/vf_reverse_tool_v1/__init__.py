"""vf-reverse-tool-v1: the same task with a tool, multi-turn: the model may call
``reverse_tools_reverse`` (an MCP tool the null harness offers) and then answers."""

import verifiers.v1 as vf

from vf_reverse_tool_v1.tools import ReverseToolset


class ReverseData(vf.TaskData):
    answer: str


class ReverseTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class ReverseToolTask(vf.Task[ReverseData, vf.State, ReverseTaskConfig]):
    @classmethod
    def toolsets(cls, config: ReverseTaskConfig) -> list[vf.Toolset]:
        return [ReverseToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def exact(self, task: ReverseData, trace: vf.Trace) -> float:
        return float((trace.last_reply or "").strip() == task.answer)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class ReverseToolConfig(vf.TasksetConfig):
    words: list[str] = ["hello", "world", "python", "rollout"]
    task: ReverseTaskConfig = ReverseTaskConfig()


class ReverseToolTaskset(vf.Taskset[ReverseToolTask, ReverseToolConfig]):
    def load(self):
        for w in self.config.words:
            yield ReverseToolTask(ReverseData(id=w, prompt=f"Use the reverse tool on '{w}', then reply with its "
                                                           f"result only.", answer=w[::-1]), self.config.task)


__all__ = ["ReverseToolTaskset"]
