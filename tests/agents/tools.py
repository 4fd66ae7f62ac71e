"""Tool schemas of many shapes for the agent suite: each with a request a model would answer by
calling it."""

def fn(name, description, parameters):
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def obj(properties, required=None, **extra):
    schema = {"type": "object", "properties": properties}
    if required is not None:
        schema["required"] = required
    schema.update(extra)
    return schema


S = {"type": "string"}
I = {"type": "integer"}
N = {"type": "number"}
B = {"type": "boolean"}

WEATHER = fn(
    "get_weather",
    "Get the current weather in a city",
    obj({"city": {"type": "string", "description": "The city's name"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"]),
)
TIME = fn("get_time", "Get the current time in a time zone", obj({"timezone": {"type": "string", "description": "An IANA time zone, e.g. Europe/Paris"}}, ["timezone"]))

# (tool, user message): over 30 shapes of parameters.
CASES = [
    (WEATHER, "What is the weather in Paris?"),
    (TIME, "What time is it in Tokyo?"),
    (fn("add", "Add two integers", obj({"a": I, "b": I}, ["a", "b"])), "What is 17 plus 25?"),
    (fn("multiply", "Multiply two numbers", obj({"x": N, "y": N}, ["x", "y"])), "Multiply 2.5 by 4."),
    (fn("set_volume", "Set the volume", obj({"level": {"type": "integer", "minimum": 0, "maximum": 100}}, ["level"])), "Turn the volume to 30."),
    (fn("set_temperature", "Set the thermostat", obj({"celsius": {"type": "number", "minimum": 5, "maximum": 30}}, ["celsius"])), "Make it 21.5 degrees."),
    (fn("toggle_light", "Switch a light", obj({"room": S, "on": B}, ["room", "on"])), "Turn off the kitchen light."),
    (fn("send_email", "Send an email", obj({"to": {"type": "string", "format": "email"}, "subject": S, "body": S}, ["to", "subject", "body"])), "Email bob@example.com that the meeting moved to 3pm."),
    (fn("search", "Search the web", obj({"query": S, "max_results": {"type": "integer", "minimum": 1, "maximum": 10}}, ["query"])), "Search for the tallest building in the world."),
    (fn("translate", "Translate text", obj({"text": S, "target": {"type": "string", "enum": ["fr", "de", "es", "it"]}}, ["text", "target"])), "Translate 'good morning' into German."),
    (fn("create_event", "Create a calendar event", obj({"title": S, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}, "attendees": {"type": "array", "items": S}}, ["title", "date"])), "Schedule a dentist visit on 2026-03-14."),
    (fn("add_tags", "Tag a note", obj({"note_id": I, "tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 5}}, ["note_id", "tags"])), "Tag note 12 with work and urgent."),
    (fn("order_pizza", "Order a pizza", obj({"size": {"enum": ["small", "medium", "large"]}, "toppings": {"type": "array", "items": {"type": "string", "enum": ["cheese", "ham", "mushroom", "olive"]}}}, ["size"])), "Order a large pizza with ham and mushrooms."),
    (fn("book_flight", "Book a flight", obj({"from": S, "to": S, "passengers": {"type": "integer", "minimum": 1, "maximum": 9}, "class": {"type": "string", "enum": ["economy", "business"]}}, ["from", "to", "passengers"])), "Book 2 economy seats from Oslo to Rome."),
    (fn("create_user", "Create a user account", obj({"user": obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 150}, "email": S}, ["name", "age"])}, ["user"])), "Create an account for Alice, who is 34."),
    (fn("update_address", "Update a customer's address", obj({"customer_id": I, "address": obj({"street": S, "city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, ["street", "city", "zip"])}, ["customer_id", "address"])), "Customer 7 moved to 5 Main St, Springfield 12345."),
    (fn("plot", "Plot points", obj({"points": {"type": "array", "items": obj({"x": N, "y": N}, ["x", "y"]), "minItems": 1}}, ["points"])), "Plot the points (1, 2) and (3, 4)."),
    (fn("rate", "Rate a movie", obj({"movie": S, "stars": {"type": "integer", "enum": [1, 2, 3, 4, 5]}}, ["movie", "stars"])), "Give Inception 5 stars."),
    (fn("convert_currency", "Convert money", obj({"amount": {"type": "number", "exclusiveMinimum": 0}, "from": {"type": "string", "pattern": "^[A-Z]{3}$"}, "to": {"type": "string", "pattern": "^[A-Z]{3}$"}}, ["amount", "from", "to"])), "Convert 100 USD to EUR."),
    (fn("set_alarm", "Set an alarm", obj({"hour": {"type": "integer", "minimum": 0, "maximum": 23}, "minute": {"type": "integer", "minimum": 0, "maximum": 59}, "label": S}, ["hour", "minute"])), "Wake me at 6:45."),
    (fn("resize_image", "Resize an image", obj({"path": S, "width": {"type": "integer", "minimum": 1, "maximum": 10000}, "height": {"type": "integer", "minimum": 1, "maximum": 10000}, "keep_aspect": B}, ["path", "width"])), "Resize photo.png to 800 pixels wide."),
    (fn("run_sql", "Run a read-only SQL query", obj({"query": {"type": "string", "maxLength": 500}}, ["query"])), "How many rows does the users table have?"),
    (fn("get_stock_price", "Get a stock's price", obj({"ticker": {"type": "string", "pattern": "^[A-Z]{1,5}$"}}, ["ticker"])), "What is Apple's stock price?"),
    (fn("log_workout", "Log a workout", obj({"activity": {"type": "string", "enum": ["run", "swim", "bike"]}, "minutes": {"type": "integer", "minimum": 1}, "distance_km": N}, ["activity", "minutes"])), "I swam for 40 minutes."),
    (fn("reply_ticket", "Answer a support ticket", obj({"ticket": I, "status": {"type": "string", "enum": ["open", "pending", "closed"]}, "message": S}, ["ticket", "status", "message"])), "Close ticket 881 and tell them it is fixed."),
    (fn("set_preferences", "Save display preferences", obj({"theme": {"enum": ["light", "dark"]}, "font_size": {"type": "integer", "minimum": 8, "maximum": 32}, "notifications": obj({"email": B, "sms": B})}, ["theme"])), "Switch to dark mode with 14 point text."),
    (fn("route", "Plan a route", obj({"stops": {"type": "array", "items": S, "minItems": 2, "maxItems": 6}, "mode": {"type": "string", "enum": ["car", "bike", "walk"]}}, ["stops"])), "Plan a bike route from home to the park to the library."),
    (fn("compute_stats", "Mean and spread of numbers", obj({"values": {"type": "array", "items": N, "minItems": 1}}, ["values"])), "What is the mean of 3, 5 and 10?"),
    (fn("lookup_word", "Look up a word", obj({"word": {"type": "string", "minLength": 1, "maxLength": 40}, "language": {"type": "string", "default": "en"}}, ["word"])), "What does 'ephemeral' mean?"),
    (fn("create_invoice", "Create an invoice", obj({"customer": S, "items": {"type": "array", "items": obj({"description": S, "quantity": {"type": "integer", "minimum": 1}, "price": {"type": "number", "minimum": 0}}, ["description", "quantity", "price"]), "minItems": 1}, "currency": {"type": "string", "enum": ["USD", "EUR"]}}, ["customer", "items"])), "Invoice ACME for 3 widgets at 9.99 USD each."),
    (fn("flag", "Flag content", obj({"content_id": S, "reason": {"anyOf": [{"type": "string", "enum": ["spam", "abuse"]}, {"type": "null"}]}}, ["content_id"])), "Flag post p-42 as spam."),
    (fn("set_status", "Set your status", obj({"text": S, "emoji": S, "expires_in_minutes": {"type": ["integer", "null"], "minimum": 1, "maximum": 1440}}, ["text"], additionalProperties=False)), "Set my status to 'in a meeting' for an hour."),
    (fn("geocode", "Coordinates of a place", {"type": "object", "properties": {"place": S}, "required": ["place"], "$defs": {"unused": S}}), "Where is the Eiffel Tower?"),
    (fn("noop", "Ping the server", {"type": "object", "properties": {}}), "Ping the server."),
    # As pydantic writes a nested model (openai-agents' function tools do): references into `$defs`.
    (fn("place_order", "Place an order", {
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "minItems": 1}, "express": {"type": "boolean"}},
        "required": ["items"],
        "$defs": {"Item": {"type": "object", "properties": {"sku": {"type": "string"}, "count": {"type": "integer", "minimum": 1, "maximum": 99}}, "required": ["sku", "count"]}},
    }), "Order two of item A-1 and one of item B-7, express."),
]
