"""Ten JSON schemas (nested objects, enums, arrays, bounded numbers, $ref, anyOf, nullable) with a
prompt each, shared by the engine's and the server's structured-output tests. Strings and
arrays are bounded, so that every document ends within MAX_TOKENS whatever the model writes."""

from __future__ import annotations

MAX_TOKENS = 160

SCHEMAS: list[tuple[str, dict, str]] = [
    ("person", {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        },
        "required": ["name", "age", "city"], "additionalProperties": False,
    }, "Describe a person as JSON with a name, an age and a city."),
    ("product", {
        "type": "object",
        "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "in_stock": {"type": "boolean"},
        },
        "required": ["sku", "price", "in_stock"], "additionalProperties": False,
    }, "Give a product record as JSON: sku, price and whether it is in stock."),
    ("account", {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                               "name": {"type": "string", "maxLength": 20}},
                "required": ["id", "name"], "additionalProperties": False,
            },
            "roles": {"type": "array", "items": {"type": "string", "enum": ["admin", "editor", "viewer"]},
                      "minItems": 1, "maxItems": 3},
        },
        "required": ["user", "roles"], "additionalProperties": False,
    }, "Return a user account with its roles as JSON."),
    ("numbers", {
        "type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50}, "minItems": 2, "maxItems": 5,
    }, "List a few small integers as a JSON array."),
    ("weather", {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "temperature": {"type": "number", "minimum": -50, "maximum": 60},
        },
        "required": ["city", "unit", "temperature"], "additionalProperties": False,
    }, "What is the weather in Paris? Answer in JSON."),
    ("measurement", {
        "type": "object",
        "properties": {
            "kind": {"type": "string", "enum": ["count", "label"]},
            "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100},
                                {"type": "string", "maxLength": 10}]},
        },
        "required": ["kind", "value"], "additionalProperties": False,
    }, "Give one measurement as JSON with a kind and a value."),
    ("segment", {
        "$defs": {"point": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -10, "maximum": 10},
                           "y": {"type": "integer", "minimum": -10, "maximum": 10}},
            "required": ["x", "y"], "additionalProperties": False,
        }},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"], "additionalProperties": False,
    }, "Describe a line segment by its two end points as JSON."),
    ("task", {
        "type": "object",
        "properties": {
            "done": {"type": "boolean"},
            "note": {"type": ["string", "null"], "maxLength": 20},
            "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        },
        "required": ["done", "note", "priority"], "additionalProperties": False,
    }, "Describe a to-do item as JSON."),
    ("order", {
        "type": "object",
        "properties": {
            "items": {"type": "array", "maxItems": 3, "minItems": 1, "items": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 15},
                               "qty": {"type": "integer", "minimum": 1, "maximum": 10}},
                "required": ["name", "qty"], "additionalProperties": False,
            }},
            "total": {"type": "number", "minimum": 0, "maximum": 500},
        },
        "required": ["items", "total"], "additionalProperties": False,
    }, "Write a shopping order as JSON with items and a total."),
    ("book", {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "year": {"type": "integer", "minimum": 1800, "maximum": 2025},
            "genres": {"type": "array", "items": {"type": "string", "enum": ["fiction", "history", "science"]},
                       "maxItems": 3},
            "rating": {"type": "number", "minimum": 0, "maximum": 5},
        },
        "required": ["title", "year", "genres", "rating"], "additionalProperties": False,
    }, "Describe a book as JSON."),
]
