"""Whether a JSON schema admits any finite value: a schema every instance of which must contain itself (through
`$ref`) has none, and a grammar built from it either accepts nothing or never ends.

    {"$ref": "#"}                                                     no value: a pure cycle
    {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}       no value: x must nest forever
    the same with "x" optional, or an array of itself                               finite: {} and [] end it

A least fixpoint over the schema's nodes: a node admits a finite value when each of its parts that every
instance must have does (allOf: all, anyOf / oneOf: one, an object's required properties, an array's first
minItems items, a $ref's target), assuming nothing of a node still being decided. Local references only
(`#`, `#/$defs/...`, `#/definitions/...`, JSON pointers); others are left to the grammar engine.
"""

from __future__ import annotations

from typing import Any, Optional

MAX_PASSES = 10_000


def _resolve(root: Any, ref: str) -> Optional[Any]:
    if not ref.startswith("#"):
        return None
    node = root
    for token in [part for part in ref[1:].split("/") if part]:
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node


class _Finite:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.known: dict[int, bool] = {}  # the last pass's answers: what a node still being decided assumes
        self.answers: dict[int, bool] = {}
        self.deciding: set[int] = set()

    def of(self, node: Any) -> bool:
        if isinstance(node, bool):
            return node  # false admits nothing at all
        if not isinstance(node, dict):
            return True
        key = id(node)
        if key in self.answers:
            return self.answers[key]
        if key in self.deciding:
            return self.known.get(key, False)
        self.deciding.add(key)
        try:
            answer = self._decide(node)
        finally:
            self.deciding.discard(key)
        self.answers[key] = answer
        return answer

    def _decide(self, node: dict) -> bool:
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = _resolve(self.root, ref)
            if target is not None and not self.of(target):
                return False
        for each in node.get("allOf") or ():
            if not self.of(each):
                return False
        for word in ("anyOf", "oneOf"):
            branches = node.get(word)
            if isinstance(branches, list) and branches and not any(self.of(each) for each in branches):
                return False
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = node.get("required") if isinstance(node.get("required"), list) else []
        extra = node.get("additionalProperties")
        for name in required:
            schema = properties.get(name, extra if isinstance(extra, (dict, bool)) else True)
            if not self.of(schema):
                return False
        min_items = node.get("minItems", 0)
        if isinstance(min_items, int) and min_items > 0:
            prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
            for index in range(min_items):
                schema = prefix[index] if index < len(prefix) else node.get("items", True)
                if not self.of(schema):
                    return False
        return True


def admits_finite_value(schema: Any) -> bool:
    finite = _Finite(schema)
    for _ in range(MAX_PASSES):
        finite.answers = {}
        answer = finite.of(schema)
        if finite.answers == finite.known:
            return answer
        finite.known = finite.answers
    return True  # not settled: leave it to the grammar engine
