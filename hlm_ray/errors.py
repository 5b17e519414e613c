"""The one exception type users see.

Raise `HLMError` for bad input: the message is a single line that says what was wrong and what
to do. The CLI prints it as ``error: <message>`` and exits with status 2, without a traceback.

    raise HLMError("tokenizer.vocab_size=100 is below the 261 byte-level + special tokens; use >= 261")
"""


class HLMError(Exception):
    """Bad input or an unusable environment, explained in one line."""
