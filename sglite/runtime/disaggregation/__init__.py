"""Disaggregated prefill and decode (docs/pd.md).

A prefill server (`--disaggregation-mode prefill`) computes a request's prompt and its first
token and hands the prompt's KV pages to a decode server (`--disaggregation-mode decode`), which
generates the rest. `messages.py` is the wire protocol, `pages.py` moves pages between a KV
pool and bytes, `transport.py` carries the bytes (TCP or shared memory), `prefill_side.py` and
`decode_side.py` are the two schedulers' halves.
"""
