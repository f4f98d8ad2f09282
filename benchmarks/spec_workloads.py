"""bench_spec's workloads: the chat prompts it decodes, by name, and which are asked again.

Copy-heavy prompts (repeat a passage, edit code, quote a retrieved passage, fill a JSON record
from a document), where n-gram drafts find their tokens in the prompt; free chat, where they do
not; and `REASKED`, the workloads measured after a full run of the same request, so that its
answer sits in the radix cache to draft from.
"""

from __future__ import annotations

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


PASSAGE = (
    "Radix attention keeps the key-value cache of finished requests in a radix tree, so that a "
    "new request sharing a prefix with an earlier one reuses its cached keys and values instead "
    "of computing them again. The tree is evicted leaf first, least recently used first, and a "
    "request's path is locked while it runs so that its cache cannot be evicted under it."
)


CODE = (
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(values)\n\n\ndef variance(values):\n    m = mean(values)\n"
    "    return sum((v - m) ** 2 for v in values) / len(values)\n"
)


DOCUMENT = (
    "Invoice 2291 was issued on 3 March 2025 by Northwind Traders, 12 Harbour Street, Bristol, "
    "to Contoso Ltd for 40 units of item A-113 at 12.50 each, total 500.00, due in 30 days."
)


WORKLOADS = {
    "copy: repeat a passage": CHAT.format(f"Repeat this text exactly:\n\n{PASSAGE}"),
    "copy: edit code": CHAT.format(f"Rename `values` to `xs` everywhere in this code:\n\n{CODE}"),
    "copy: quote a retrieved passage": CHAT.format(
        f"Context:\n{PASSAGE}\n\nQuestion: how is the cache evicted? Answer by quoting the context."
    ),
    "copy: JSON record from a document": CHAT.format(
        f"Document:\n{DOCUMENT}\n\nWrite the invoice as a JSON object with fields number, date, "
        "seller, buyer, item, quantity, unit_price and total."
    ),
    "free chat": CHAT.format("Write a short story about a robot who learns to paint."),
    "free chat: advice": CHAT.format("Give me some advice on learning to play the piano."),
    "free chat, asked again": CHAT.format("Give me some advice on learning to play the piano."),
}


# Workloads whose measured run follows the same request's full run (its answer cached).
REASKED = {"free chat, asked again"}
