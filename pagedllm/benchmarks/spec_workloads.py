"""Chat workloads for `pagedllm bench spec-decode`: where the reply repeats its input, and where it does not.

Each builder returns `num_prompts` conversations (lists of chat messages), deterministic for a seed:
- `proofread`: a passage about a fictional place, person or product with one misspelt word, to give
  back corrected (replies quote it);
- `code-edit`: a function from this repository's source, to rewrite with one name changed;
- `extract`: an invoice, shipping notice, booking or job advert, whose fields to copy out one per line;
- `chat`: open-ended questions, whose replies have no text to repeat;
- `summarize` (not in the default set): a passage to summarise; this small model paraphrases more than
  it quotes there.
The passages and documents are made from templates with random fillers, so any number of distinct ones
exists and no model has seen them.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pagedllm

GROUNDED_WORKLOADS = ("proofread", "code-edit", "extract")
CHAT_WORKLOADS = GROUNDED_WORKLOADS + ("chat",)  # the default set, and the mixed workload's parts
ALL_WORKLOADS = CHAT_WORKLOADS + ("summarize",)

Conversation = list[dict[str, str]]

_NAMES = ["Maria Jensen", "Tomas Okafor", "Lena Fischer", "Ravi Menon", "Chloe Dubois", "Kenji Watanabe",
          "Amara Nwosu", "Pavel Novak", "Sofia Marquez", "Elias Berg", "Hannah Cole", "Omar Haddad"]
_TOWNS = ["Eastbrook", "Marlow Bay", "Kestrel Falls", "Ashford Green", "Port Halden", "Wrenfield", "Oakmere",
          "Stonehaven", "Larkspur", "Fenwick Cross", "Brightwater", "Millbridge"]
_RIVERS = ["Aven", "Tessel", "Marrow", "Linden", "Colne", "Hartwell"]
_PRODUCTS = [("desk lamp", 24.5), ("office chair", 189.0), ("wireless keyboard", 49.9), ("monitor stand", 35.0),
             ("coffee grinder", 79.0), ("hiking backpack", 119.0), ("water filter", 29.95), ("tent", 249.0)]
_TRADES = ["bakery", "bicycle repair shop", "bookshop", "pottery studio", "language school", "plant nursery"]

_PASSAGES = [
    "The town of {town} lies on the {river} river, about {km} kilometres north of the coast. It was founded in "
    "{year} as a market town for the farms of the valley, and its stone bridge, built twenty years later, still "
    "carries traffic today. The town is known for its autumn fair, which draws around {visitors} visitors every "
    "October, and for the {trade} on the main square, run by the same family for four generations. In recent "
    "years {town} has grown as people from the city move there for quieter streets and cheaper houses.",
    "{name} opened a small {trade} in {town} in {year}. At first the shop had only two rooms and no heating, "
    "and {first} worked alone six days a week. Within five years the business had {staff} employees and a "
    "second branch near the station. {first} says the secret was simple: listen to customers, keep prices fair, "
    "and never close on a market day. The original shop is now a cafe, but the sign above the door still "
    "carries the old name.",
    "The {product} from {brand} is designed for small homes and offices. It weighs {weight} kilograms, folds flat "
    "for storage and comes with a {warranty}-year warranty. Reviewers praise its quiet operation and solid build, "
    "though some find the controls hard to read in low light. It is sold in three colours, grey, white and "
    "green, and costs {price:.2f} euros in most shops. A replacement part can be ordered online and usually "
    "arrives within a week.",
    "Every spring the {river} river floods the low fields south of {town}. The floods leave rich soil behind, "
    "which is why the area grows some of the best vegetables in the region, but they also close the main road "
    "for several days each year. In {year} the council built a new embankment, {km} kilometres long, which has "
    "reduced the damage. Farmers still plant late in the season to be safe, and the local school teaches "
    "children what to do when the water rises.",
]

_DOCUMENTS = [
    ("Invoice {number}\nBilled to: {name}, {street} {road}, {town}\nDate: {day} {month} {year}\n"
     "Items: {qty} x {product} at {price:.2f} EUR; 1 x {product2} at {price2:.2f} EUR\nTotal: {total:.2f} EUR\n"
     "Payment due within 30 days.",
     ["invoice_number", "customer_name", "date", "city", "total"]),
    ("SHIPPING NOTICE\nOrder reference: {number}\nRecipient: {name}\nAddress: {street} {road}, {town}\n"
     "Carrier: {carrier}\nDispatched: {day} {month} {year}\nParcels: {qty}\nContents: {product}\n"
     "Expected delivery: 3 to 5 working days.",
     ["order_reference", "recipient", "address", "carrier", "dispatch_date", "parcels"]),
    ("Booking confirmation\nGuest: {name}\nHotel: The {town} Inn\nCheck-in: {day} {month} {year}, from 15:00\n"
     "Nights: {qty}\nRoom: double room with river view\nRate: {price:.2f} EUR per night\nBooking number: {number}",
     ["guest_name", "hotel", "check_in_date", "nights", "rate_per_night", "booking_number"]),
    ("Job advert: {trade} assistant\nEmployer: {name}, {town}\nHours: {qty} days a week\n"
     "Pay: {price:.2f} EUR per hour\nStart date: {day} {month} {year}\nApply by email before the end of {month}, "
     "quoting reference {number}.",
     ["job_title", "employer", "town", "days_per_week", "hourly_pay", "start_date", "reference"]),
]
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December"]
_ROADS = ["Harbour Road", "Mill Lane", "Station Street", "Church Walk", "Orchard Close", "High Street"]

CHAT_QUESTIONS = [
    "What are some good ways to spend a rainy weekend?",
    "Write a short poem about the first snow of winter.",
    "How can I get better at remembering people's names?",
    "Give me three ideas for a birthday party for a ten-year-old.",
    "Why do cats like to sit in boxes?",
    "What should I think about before adopting a dog?",
    "Tell me a short story about a lighthouse keeper.",
    "How do I start learning to play the guitar?",
    "What are the benefits of taking a walk every day?",
    "Suggest a simple vegetarian dinner I can cook in thirty minutes.",
    "How can I make my mornings less stressful?",
    "What is a good way to start a conversation with a new neighbour?",
    "Describe a perfect summer day at the beach.",
    "What tips do you have for a first job interview?",
    "Why is it important to drink enough water?",
    "How can I keep my house plants healthy?",
]


def _passage(rng: random.Random, index: int) -> str:
    name = rng.choice(_NAMES)
    product, price = rng.choice(_PRODUCTS)
    return _PASSAGES[index % len(_PASSAGES)].format(
        town=rng.choice(_TOWNS), river=rng.choice(_RIVERS), km=rng.randint(3, 40), year=rng.randint(1650, 1990),
        visitors=rng.choice(["2,000", "5,000", "12,000", "20,000"]), trade=rng.choice(_TRADES), name=name,
        first=name.split()[0], staff=rng.randint(4, 30), product=product, brand=rng.choice(["Norda", "Velt", "Kaito"]),
        weight=rng.choice(["1.2", "2.5", "3.8", "4.1"]), warranty=rng.choice([2, 3, 5]), price=price)


def _document(rng: random.Random, index: int) -> tuple[str, list[str]]:
    template, fields = _DOCUMENTS[index % len(_DOCUMENTS)]
    (product, price), (product2, price2) = rng.sample(_PRODUCTS, 2)
    qty = rng.randint(1, 5)
    text = template.format(
        number=rng.randint(1000, 99999), name=rng.choice(_NAMES), street=rng.randint(1, 180), road=rng.choice(_ROADS),
        town=rng.choice(_TOWNS), day=rng.randint(1, 28), month=rng.choice(_MONTHS), year=rng.randint(2019, 2025),
        qty=qty, product=product, price=price if index % 4 != 3 else rng.choice([11.5, 13.25, 16.0]),
        product2=product2, price2=price2, total=qty * price + price2, carrier=rng.choice(["DHL", "UPS", "PostNord"]),
        trade=rng.choice(_TRADES))
    return text, fields


def _functions(num_prompts: int) -> list[tuple[str, str]]:
    """(source, a parameter name) of functions of 8 to 30 lines from this repository, evenly spread."""
    found = []
    for path in sorted(Path(pagedllm.__file__).parent.rglob("*.py")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            match = re.match(r"(\s*)def \w+\((?:self, )?(\w+)", line)
            if not match or match.group(2) == "self":
                continue
            indent, end = len(match.group(1)), i + 1
            while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
                end += 1
            if 8 <= end - i <= 30:
                body = [line[indent:] for line in lines[i:end]]
                found.append(("\n".join(body).rstrip() + "\n", match.group(2)))
    if len(found) < num_prompts:
        raise ValueError(f"only {len(found)} functions of 8 to 30 lines; lower --num-prompts")
    step = len(found) / num_prompts
    return [found[int(i * step)] for i in range(num_prompts)]


def build_workload(name: str, num_prompts: int, seed: int = 0) -> list[Conversation]:
    rng = random.Random(f"{name}-{seed}")
    if name == "proofread":
        return [[{"role": "user", "content": "Correct the spelling mistake in the following text. Reply with the "
                  f"corrected text only.\n\n{_passage(rng, i).replace(' the ', ' teh ', 1)}"}]
                for i in range(num_prompts)]
    if name == "summarize":
        return [[{"role": "user", "content": f"Summarize the following passage.\n\n{_passage(rng, i)}"}]
                for i in range(num_prompts)]
    if name == "code-edit":
        return [[{"role": "user", "content": f"Rewrite this Python function, renaming the parameter `{param}` to "
                  f"`{param}_value`. Reply with the code only.\n\n```python\n{source}```"}]
                for source, param in _functions(num_prompts)]
    if name == "extract":
        conversations = []
        for i in range(num_prompts):
            text, fields = _document(rng, i)
            conversations.append([{"role": "user", "content": "Copy these fields from the document below, one per "
                                   f"line as `field: value`: {', '.join(fields)}.\n\n{text}"}])
        return conversations
    if name == "chat":
        return [[{"role": "user", "content": CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]}] for i in range(num_prompts)]
    raise ValueError(f"workload must be one of {list(ALL_WORKLOADS)}, got {name!r}.")


def mixed_workload(num_prompts: int, seed: int = 0) -> list[Conversation]:
    """The four workloads interleaved (summarize, code-edit, extract, chat, summarize, ...)."""
    per = -(-num_prompts // len(CHAT_WORKLOADS))
    parts = [build_workload(name, per, seed) for name in CHAT_WORKLOADS]
    return [parts[i % len(parts)][i // len(parts)] for i in range(num_prompts)]
