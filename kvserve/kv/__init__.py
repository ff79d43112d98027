"""The KV cache's bookkeeping: which blocks exist, who holds them, what they contain.

Plain Python over block ids and token ids; no torch. The tensors live in the runner's KV pool
(``kvserve.attention.KVPool``); ``layout.py`` defines their size for both.
"""
