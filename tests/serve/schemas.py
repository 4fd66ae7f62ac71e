"""JSON schemas of many shapes, each with the request that asks for it, for the structured-output
tests: objects, arrays, enums, nesting, numbers with ranges, strings with lengths and patterns,
unions, references, constants. The model sees only the task; the schema constrains its reply.
"""

S = {"type": "string", "maxLength": 40}
I = {"type": "integer"}


def obj(props, required=None, extra=False):
    o = {"type": "object", "properties": props, "required": list(props) if required is None else required}
    if not extra:
        o["additionalProperties"] = False
    return o


CASES = [
    ("person", "Describe Alice, a 30 year old engineer.", obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 150}})),
    ("city", "Give the capital of France and its population.", obj({"city": S, "population": {"type": "integer", "minimum": 0}})),
    ("boolean", "Is water wet?", {"type": "boolean"}),
    ("integer-range", "Pick a number from 1 to 10.", {"type": "integer", "minimum": 1, "maximum": 10}),
    ("negative-range", "Give a temperature in Celsius between -40 and -1.", {"type": "integer", "minimum": -40, "maximum": -1}),
    ("exclusive-range", "Give a probability strictly between 0 and 1.", {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}),
    ("float-range", "Give the price of a coffee in euros.", obj({"price": {"type": "number", "minimum": 0.5, "maximum": 9.99}})),
    ("enum", "What color is the sky on a clear day?", {"enum": ["red", "green", "blue"]}),
    ("enum-object", "Rate this movie.", obj({"rating": {"enum": ["bad", "ok", "good", "great"]}, "stars": {"type": "integer", "minimum": 1, "maximum": 5}})),
    ("mixed-enum", "Answer yes, no, or give a count.", {"enum": ["yes", "no", 0, 1, 2, None, True]}),
    ("const", "Acknowledge.", obj({"status": {"const": "ok"}, "code": {"const": 200}})),
    ("string-array", "List three fruits.", {"type": "array", "items": S, "minItems": 3, "maxItems": 3}),
    ("int-array", "List the first five prime numbers.", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 5, "maxItems": 5}),
    ("bounded-array", "Name up to four planets.", {"type": "array", "items": {"enum": ["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"]}, "maxItems": 4}),
    ("unique-items", "Pick two different sizes.", {"type": "array", "items": {"enum": ["S", "M", "L"]}, "minItems": 2, "maxItems": 2}),
    ("nested", "Describe a book and its author.", obj({"title": S, "author": obj({"name": S, "born": {"type": "integer", "minimum": 1000, "maximum": 2025}})})),
    ("deep", "Give a location as country, region and city.", obj({"country": obj({"name": S, "region": obj({"name": S, "city": obj({"name": S})})})})),
    ("array-of-objects", "List two employees with their ages.", {"type": "array", "items": obj({"name": S, "age": {"type": "integer", "minimum": 18, "maximum": 99}}), "minItems": 2, "maxItems": 2}),
    ("object-with-array", "Describe a recipe with up to three ingredients.", obj({"dish": S, "ingredients": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}})),
    ("optional", "Describe a user; the email is optional.", obj({"user": S, "email": S}, required=["user"])),
    ("nullable", "Give a middle name, or null if there is none.", obj({"first": S, "middle": {"type": ["string", "null"], "maxLength": 20}})),
    ("any-of", "Give an identifier: a number or a short code.", obj({"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99999}, {"type": "string", "maxLength": 8}]}})),
    ("one-of", "Give a shape: a circle with a radius or a square with a side.", {"oneOf": [obj({"kind": {"const": "circle"}, "radius": {"type": "integer", "minimum": 1, "maximum": 100}}), obj({"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1, "maximum": 100}})]}),
    ("all-of", "Describe a product with a name and a price.", {"allOf": [{"type": "object", "properties": {"name": S}, "required": ["name"]}, {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000}}, "required": ["price"]}], "properties": {"name": S, "price": {"type": "number"}}, "additionalProperties": False}),
    ("ref", "Give a start point and an end point.", {"$defs": {"point": obj({"x": {"type": "integer", "minimum": -100, "maximum": 100}, "y": {"type": "integer", "minimum": -100, "maximum": 100}})}, "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}, "required": ["start", "end"], "additionalProperties": False}),
    ("pattern", "Give a US zip code.", obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}})),
    ("pattern-phone", "Give a phone number.", obj({"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{3}-[0-9]{4}$"}})),
    ("hex-color", "Give a color as hex.", obj({"color": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}})),
    ("min-length", "Give a password of at least 8 characters.", obj({"password": {"type": "string", "minLength": 8, "maxLength": 16}})),
    ("date", "When did the Apollo 11 landing happen?", obj({"date": {"type": "string", "format": "date"}})),
    ("email", "Give an email address for Bob.", obj({"email": {"type": "string", "format": "email", "maxLength": 40}})),
    ("multiple-of", "Give an even number below 50.", obj({"n": {"type": "integer", "multipleOf": 2, "minimum": 0, "maximum": 48}})),
    ("unbounded-int", "How many legs does a spider have?", obj({"legs": I})),
    ("unbounded-number", "What is the value of pi to two decimals?", obj({"pi": {"type": "number"}})),
    ("bool-flags", "Describe a light switch state.", obj({"on": {"type": "boolean"}, "dimmable": {"type": "boolean"}})),
    ("tuple", "Give a latitude and longitude pair for Paris.", {"type": "array", "prefixItems": [{"type": "number", "minimum": -90, "maximum": 90}, {"type": "number", "minimum": -180, "maximum": 180}], "items": False}),
    ("matrix", "Give a 2 by 2 identity matrix.", {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 1}, "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}),
    ("map", "Give the ages of two people by name.", {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 120}, "maxProperties": 2}),
    ("empty-object", "Reply with an empty object.", {"type": "object", "properties": {}, "additionalProperties": False}),
    ("any-object", "Give a small JSON object about a cat.", {"type": "object", "properties": {"name": S}, "required": ["name"], "maxProperties": 1}),
    ("event", "Describe a meeting: title, day of week, and duration in minutes.", obj({"title": S, "day": {"enum": ["Mon", "Tue", "Wed", "Thu", "Fri"]}, "minutes": {"type": "integer", "minimum": 15, "maximum": 240}})),
    ("order", "Describe an order of two items with quantities.", obj({"items": {"type": "array", "items": obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{3}$"}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}), "minItems": 2, "maxItems": 2}, "paid": {"type": "boolean"}})),
    ("weather", "Give today's weather for London.", obj({"city": S, "celsius": {"type": "number", "minimum": -50, "maximum": 60}, "sky": {"enum": ["sunny", "cloudy", "rain", "snow"]}})),
    ("sentiment", "Classify: 'I love this phone.'", obj({"label": {"enum": ["positive", "negative", "neutral"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("translation", "Translate 'cat' into French.", obj({"source": {"const": "cat"}, "french": {"type": "string", "maxLength": 20}})),
    ("version", "Give a semantic version number.", obj({"version": {"type": "string", "pattern": "^[0-9]{1,2}\\.[0-9]{1,2}\\.[0-9]{1,2}$"}})),
    ("rgb", "Give the RGB values of pure red.", obj({"r": {"type": "integer", "minimum": 0, "maximum": 255}, "g": {"type": "integer", "minimum": 0, "maximum": 255}, "b": {"type": "integer", "minimum": 0, "maximum": 255}})),
    ("tags", "Give up to three tags for a photo of a beach.", obj({"tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,12}$"}, "minItems": 1, "maxItems": 3}})),
    ("nullable-number", "Give the height of a building in meters, or null if unknown.", obj({"height": {"type": ["number", "null"], "minimum": 0, "maximum": 1000}})),
    ("string-enum-array", "Which days are weekend days?", {"type": "array", "items": {"enum": ["Saturday", "Sunday", "Monday"]}, "minItems": 1, "maxItems": 2}),
    ("recursive", "Give a tree with a root node labeled A and no children.", {"$defs": {"node": {"type": "object", "properties": {"label": {"type": "string", "maxLength": 4}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}, "required": ["label", "children"], "additionalProperties": False}}, "$ref": "#/$defs/node"}),
    ("string", "Say hello.", {"type": "string", "maxLength": 30}),
    ("null", "Reply with null.", {"type": "null"}),
    ("number-array", "Give three decimal numbers between 0 and 1.", {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "minItems": 3, "maxItems": 3}),
]
