"""ReAct agent: the model picks a tool with `select`, writes its input with `gen`, and Python runs
the tool and appends the observation.

Pattern: control flow in plain Python around the model: `select` restricts the action to the
known tools (no parsing of free text), `gen` with a stop string produces the tool input, and
reading `s["action"]` waits for the decision before the program branches on it.

Run: python examples/react_agent.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

import argparse
import ast
import operator

import sglite as sgl

FACTS = {"france": "Paris is the capital of France.", "water": "Water boils at 100 C."}
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def calculator(expression: str) -> str:
    """Evaluate + - * / over numbers (nothing else is accepted)."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("unsupported expression")

    try:
        return str(value(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"


def lookup(query: str) -> str:
    """Look a keyword up in a tiny fact table."""
    for key, fact in FACTS.items():
        if key in query.lower():
            return fact
    return "no fact found"


TOOLS = {"calculator": calculator, "lookup": lookup}


@sgl.function
def react_agent(s, question, max_steps=2):
    s += (
        "Answer the question using tools. Tools: calculator (arithmetic), lookup (facts).\n"
        "Question: What is 6 * 7?\nAction: calculator\nAction Input: 6 * 7\nObservation: 42\n"
        "Action: finish\nAnswer: 42\n\n"
    )
    s += "Question: " + question + "\n"
    for _ in range(max_steps):
        s += "Action: " + sgl.select("action", choices=["calculator", "lookup", "finish"])
        if s["action"] == "finish":
            break
        s += "\nAction Input:" + sgl.gen("action_input", max_tokens=10, stop="\n")
        s += "\nObservation: " + TOOLS[s["action"]](s["action_input"]) + "\n"
    s += "\nAnswer:" + sgl.gen("answer", max_tokens=10, stop="\n")


def make_backend() -> sgl.RuntimeEndpoint | sgl.EngineBackend:
    """A running server with --url, else the default model in this process."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="use a running server instead of an in-process Engine")
    args = parser.parse_args()
    return sgl.RuntimeEndpoint(args.url) if args.url else sgl.EngineBackend()


def main() -> None:
    backend = make_backend()
    state = react_agent.run(question="What is 12 + 30?", backend=backend, temperature=0)
    if state.error():
        raise state.error()
    print(state.text())
    backend.shutdown()


if __name__ == "__main__":
    main()
