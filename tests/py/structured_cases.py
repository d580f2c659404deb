"""Constraints for the structured-output serving tests and benchmark, each with an
independent check of what comes back (jsonschema, a recursive-descent parser)."""

from __future__ import annotations

import json
import re

import jsonschema

_S = {"type": "string", "maxLength": 12}  # bounded, so a tiny model ends its strings

# name -> (prompt, schema). Sizes are bounded so SmolLM2 finishes well within max_tokens.
SCHEMAS: dict[str, tuple[str, dict]] = {
    "person": ("A person with a name and an age", {
        "type": "object", "properties": {"name": _S, "age": {"type": "integer", "minimum": 0,
                                                             "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False}),
    "nested_object": ("A user record with an address", {
        "type": "object", "properties": {
            "user": {"type": "object", "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 999},
                "address": {"type": "object", "properties": {"city": _S, "zip": {
                    "type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
                "required": ["id", "address"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False}),
    "int_array_bounds": ("Three small numbers", {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 2, "maxItems": 4}),
    "enum": ("The colour of the sky", {
        "type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
        "required": ["colour"], "additionalProperties": False}),
    "number_bounds": ("Today's temperature in Celsius", {
        "type": "object", "properties": {"celsius": {"type": "number", "minimum": -50,
                                                     "maximum": 50}},
        "required": ["celsius"], "additionalProperties": False}),
    "boolean": ("Is water wet?", {
        "type": "object", "properties": {"answer": {"type": "boolean"}},
        "required": ["answer"], "additionalProperties": False}),
    "optional_fields": ("A book, its title and maybe its year", {
        "type": "object", "properties": {"title": _S, "year": {"type": "integer", "minimum": 1000,
                                                               "maximum": 2100}},
        "required": ["title"], "additionalProperties": False}),
    "refs_defs": ("A line from one point to another", {
        "$defs": {"point": {"type": "object", "properties": {
            "x": {"type": "integer", "minimum": -9, "maximum": 9},
            "y": {"type": "integer", "minimum": -9, "maximum": 9}},
            "required": ["x", "y"], "additionalProperties": False}},
        "type": "object", "properties": {"start": {"$ref": "#/$defs/point"},
                                         "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"], "additionalProperties": False}),
    "any_of": ("A value that is a digit or a short word", {
        "type": "object", "properties": {"value": {"anyOf": [
            {"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 5}]}},
        "required": ["value"], "additionalProperties": False}),
    "string_pattern": ("A product code", {
        "type": "object", "properties": {"code": {"type": "string",
                                                  "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"], "additionalProperties": False}),
    "format_date": ("A birthday", {
        "type": "object", "properties": {"birthday": {"type": "string", "format": "date"}},
        "required": ["birthday"], "additionalProperties": False}),
    "format_email": ("A contact", {
        "type": "object", "properties": {"email": {"type": "string", "format": "email"}},
        "required": ["email"], "additionalProperties": False}),
    "format_uuid": ("An identifier", {
        "type": "object", "properties": {"id": {"type": "string", "format": "uuid"}},
        "required": ["id"], "additionalProperties": False}),
    "const": ("A shape", {
        "type": "object", "properties": {"kind": {"const": "circle"},
                                         "radius": {"type": "integer", "minimum": 1,
                                                    "maximum": 99}},
        "required": ["kind", "radius"], "additionalProperties": False}),
    "array_of_objects": ("Two pets", {
        "type": "array", "items": {"type": "object", "properties": {
            "name": _S, "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
            "required": ["name", "legs"], "additionalProperties": False},
        "minItems": 1, "maxItems": 2}),
    "enum_array_exact": ("Two letters", {
        "type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 2}),
    "top_level_enum": ("Yes or no?", {"enum": ["yes", "no"]}),
    "top_level_integer": ("A number from 1 to 100", {"type": "integer", "minimum": 1,
                                                     "maximum": 100}),
    "nullable": ("A nickname, if any", {
        "type": "object", "properties": {"nickname": {"type": ["string", "null"],
                                                      "maxLength": 8}},
        "required": ["nickname"], "additionalProperties": False}),
    "matrix": ("A 2 by 2 matrix of digits", {
        "type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                               "maximum": 9},
                                   "minItems": 2, "maxItems": 2},
        "minItems": 2, "maxItems": 2}),
    "movie": ("A movie review", {
        "type": "object", "properties": {
            "title": {"type": "string", "maxLength": 20},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            "rating": {"type": "number", "minimum": 0, "maximum": 10},
            "liked": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["fun", "sad", "long"]}, "maxItems": 2}},
        "required": ["title", "year", "rating", "liked", "tags"], "additionalProperties": False}),
    "string_length_exact": ("A three-letter airport code", {
        "type": "string", "minLength": 3, "maxLength": 3}),
    "one_of": ("A circle or a square", {
        "oneOf": [
            {"type": "object", "properties": {"circle": {"type": "integer", "minimum": 1,
                                                         "maximum": 9}},
             "required": ["circle"], "additionalProperties": False},
            {"type": "object", "properties": {"square": {"type": "integer", "minimum": 1,
                                                         "maximum": 9}},
             "required": ["square"], "additionalProperties": False}]}),
    "exclusive_bounds": ("A digit and a fraction", {
        "type": "object", "properties": {
            "digit": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
            "fraction": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}},
        "required": ["digit", "fraction"], "additionalProperties": False}),
}


def check_json(text: str, schema: dict) -> object:
    """The parsed value; raises unless it validates (formats checked too)."""
    value = json.loads(text)
    cls = jsonschema.validators.validator_for(schema)
    cls(schema, format_checker=cls.FORMAT_CHECKER).validate(value)
    return value


# Integer arithmetic: + - * / and parentheses (xgrammar's EBNF), optional spaces between
# tokens, numbers of at most 3 digits. A sum has at most 4 terms and a product 3 factors, so
# an expression ends (SmolLM2 would add "+ 12" forever).
ARITH_GRAMMAR = r"""
root ::= expr
expr ::= term (ws ("+" | "-") ws term){0,3}
term ::= factor (ws ("*" | "/") ws factor){0,2}
factor ::= num | "(" ws expr ws ")"
num ::= [0-9] | [1-9] [0-9] | [1-9] [0-9] [0-9]
ws ::= " "?
"""

_ARITH_TOKEN = re.compile(r" ?(?:(\d+)|(.))")  # the grammar's ws is one optional space


def parse_arith(text: str) -> int:
    """Checks text is an expression of ARITH_GRAMMAR by recursive descent (spaces allowed
    between tokens, numbers without leading zeros, at most 4 terms and 3 factors); returns
    how many operators it has. Raises ValueError otherwise."""
    tokens = []
    pos = 0
    while pos < len(text):
        m = _ARITH_TOKEN.match(text, pos)
        if m is None or (m.group(2) is not None and m.group(2).isspace()):
            break
        num, sym = m.groups()
        if num is not None and (len(num) > 3 or (len(num) > 1 and num[0] == "0")):
            raise ValueError(f"bad number {num!r}")
        if sym is not None and sym not in "+-*/()":
            raise ValueError(f"unexpected {sym!r} at {pos}")
        tokens.append(num if num is not None else sym)
        pos = m.end()
    if pos != len(text) or text[:1] == " " or text[-1:] == " ":
        raise ValueError(f"space or text outside the expression: {text!r}")
    i = 0
    ops = 0

    def peek():
        return tokens[i] if i < len(tokens) else None

    def factor():
        nonlocal i
        t = peek()
        if t is None:
            raise ValueError("expression ends early")
        if t == "(":
            i += 1
            expr()
            if peek() != ")":
                raise ValueError("missing )")
            i += 1
        elif t.isdigit():
            i += 1
        else:
            raise ValueError(f"unexpected {t!r}")

    def chain(sub, symbols, most):
        nonlocal i, ops
        sub()
        for _ in range(most):
            if peek() not in symbols:
                break
            i += 1
            ops += 1
            sub()

    def term():
        chain(factor, ("*", "/"), 2)

    def expr():
        chain(term, ("+", "-"), 3)

    expr()
    if i != len(tokens):
        raise ValueError(f"unexpected {tokens[i]!r}")
    return ops
