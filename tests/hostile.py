"""Hostile constraints shared by the grammar tests, the hostile corpus and its benchmark:
chains and nests that overflow or stall the grammar library (issue 30)."""

from __future__ import annotations


def ref_chain(n: int) -> dict:
    """A JSON schema whose $ref chain is n definitions long."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def lark_chain(n: int) -> str:
    """A Lark grammar of n rules, each the next."""
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "a"\n'


def gbnf_chain(n: int, name: str = "rule") -> str:
    """The same chain in GBNF (llama.cpp's grammar)."""
    rules = "".join(f"{name}{i} ::= {name}{i + 1}\n" for i in range(n))
    return f'root ::= {name}0\n{rules}{name}{n} ::= "a"\n'


def nested_schema(depth: int) -> dict:
    """An object schema nested ``depth`` levels."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return schema


def anchor_chain(n: int) -> dict:
    """A $ref chain through $anchor names: the structure checks follow only #/... pointers;
    the library follows these too (and overflows the worker's stack)."""

    def link(i: int) -> dict:
        if i == n:
            return {"$anchor": f"a{n}", "type": "integer"}
        return {"$anchor": f"a{i}", "type": "object", "properties": {"x": {"$ref": f"#a{i + 1}"}}}

    return {"$ref": "#a0", "$defs": {f"d{i}": link(i) for i in range(n + 1)}}


def gbnf_alternatives(n: int) -> str:
    """A shallow GBNF grammar that gbnf_to_lark is slow on (~0.5 s for n = 4,000)."""
    rules = "".join(f'w{i} ::= "x{i}"\n' for i in range(n))
    return "root ::= " + " | ".join(f"w{i}" for i in range(n)) + "\n" + rules


def schema_format(schema: dict) -> dict:
    """A request's ``response_format`` holding ``schema``."""
    return {
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    }


def unique_text(seed: int, words: int) -> str:
    """Text that shares no prefix with another seed's (no prefix-cache hit): ~3 tokens a word."""
    return " ".join(f"w{seed}x{(i * 7919 + seed) % 1009}" for i in range(words))
