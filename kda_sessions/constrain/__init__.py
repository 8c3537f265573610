"""Constrained decoding: tool calls for ``tool_choice`` (tool_choice.py), JSON replies for ``response_format``
(json_reply.py), both on the JSON prefix automaton of json_prefix.py."""
