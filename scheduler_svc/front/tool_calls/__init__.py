"""Tool calling on the chat API, as vLLM serves it: what ``tools`` and ``tool_choice`` ask for
(``requests.py``), reading calls out of a model's text (``parsers.py``, one parser per format, chosen
with ``--tool-call-parser``), and sending them as OpenAI's ``tool_calls`` (``stream.py``)."""

from scheduler_svc.front.tool_calls.parsers import AUTO_PARSERS, ToolParser
from scheduler_svc.front.tool_calls.requests import ToolCallOptions, ToolPlan, plan_tools
from scheduler_svc.front.tool_calls.stream import ChoiceToolCalls

__all__ = ["AUTO_PARSERS", "ChoiceToolCalls", "ToolCallOptions", "ToolParser", "ToolPlan", "plan_tools"]
