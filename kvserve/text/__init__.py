"""Text, in one place: everything between strings and token ids.

Owns tokenizing (``tokenizer``: the model's ``Tokenizer``, chat templates, special tokens,
``check_unicode``), incremental detokenizing (``detokenizer``), and turning a request's tokens into
what a user sees (``output``: ``RequestOutput``, ``OutputProcessor`` with stop strings and the
hold-back of a possible stop-string prefix), reading tool calls out of generated text
(``tool_formats``, ``tool_parsers``), and splitting a thinking model's reasoning from its answer
(``reasoning``). Nothing here imports torch: the engine's process and
the server use it without a model.
"""
