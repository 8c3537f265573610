"""Tokenizers (byte, tokenizer.json, tiktoken), the chat template, and tool-call parsing.

`HFTokenizer` (kda_sessions.tokenizer.hf) and `TiktokenTokenizer` (kda_sessions.tokenizer.tiktoken_tok)
are imported by `load_tokenizer` only when a checkpoint needs them.
"""

from kda_sessions.tokenizer.base import IncrementalDecoder, Segment, Tokenizer
from kda_sessions.tokenizer.byte import BYTE_SPECIALS, ByteTokenizer
from kda_sessions.tokenizer.chat import (
    ChatTemplate,
    ChatTemplateError,
    builtin_template,
    encode_chat,
    encode_chat_delta,
    encode_chat_turn,
    encode_end_of_turn,
    load_chat_template,
)
from kda_sessions.tokenizer.json_schema import validate_arguments
from kda_sessions.tokenizer.loader import TokenizerNotFound, load_tokenizer
from kda_sessions.tokenizer.tool_calls import (
    ContentDelta,
    FunctionCall,
    ParsedOutput,
    ToolCall,
    ToolCallParseError,
    ToolCallStreamParser,
    parse_assistant_output,
)

__all__ = [
    "BYTE_SPECIALS",
    "ByteTokenizer",
    "ChatTemplate",
    "ChatTemplateError",
    "ContentDelta",
    "FunctionCall",
    "IncrementalDecoder",
    "ParsedOutput",
    "Segment",
    "Tokenizer",
    "TokenizerNotFound",
    "ToolCall",
    "ToolCallParseError",
    "ToolCallStreamParser",
    "builtin_template",
    "encode_chat",
    "encode_chat_delta",
    "encode_chat_turn",
    "encode_end_of_turn",
    "load_chat_template",
    "load_tokenizer",
    "parse_assistant_output",
    "validate_arguments",
]
