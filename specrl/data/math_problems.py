"""Math word problems and arithmetic: each topic is a kind of problem whose writer draws numbers
with a seeded `random.Random` and computes the exact answer."""

from __future__ import annotations

import math
import random
from fractions import Fraction
from typing import Any, Callable, Sequence

Draft = tuple[str, Fraction | None, dict[str, Any]]  # text, answer, slots
_Draft = Draft


def format_number(x: Fraction) -> str:
    """The canonical form of a math answer: "42", "-3", "12.5" (exact; at most two decimals)."""
    if (x * 100).denominator != 1:
        raise ValueError(f"{x} has more than two decimals")
    whole, cents = divmod(abs(x.numerator * 100 // x.denominator), 100)
    sign = "-" if x < 0 else ""
    return f"{sign}{whole}" if cents == 0 else f"{sign}{whole}.{cents:02d}".rstrip("0")


# ---- math: each topic is a kind of problem; its writer draws numbers and computes the answer -------

_NAMES = ("Maya", "Liam", "Aisha", "Carlos", "Yuki", "Noah", "Priya", "Omar", "Elena", "Sam", "Grace", "Tomas",
          "Zara", "Ben", "Mei", "Diego", "Hannah", "Kofi", "Lena", "Ravi")
_GOODS = (("notebook", "notebooks"), ("coffee", "coffees"), ("movie ticket", "movie tickets"),
          ("bag of apples", "bags of apples"), ("pen", "pens"), ("sandwich", "sandwiches"),
          ("bus pass", "bus passes"), ("box of tea", "boxes of tea"), ("plant pot", "plant pots"))
_PRICED = ("jacket", "pair of headphones", "lamp", "backpack", "desk chair", "blender", "pair of boots",
           "coffee maker", "bike helmet")


def _pick(rng: random.Random, *templates: str, **slots: Any) -> str:
    return rng.choice(templates).format(**slots)


def _money(x: Fraction) -> str:
    return f"${x.numerator // x.denominator}" if x.denominator == 1 else f"${float(x):.2f}"


def join(items: Sequence[Any]) -> str:
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _clock(minutes: int) -> str:
    h, m = divmod(minutes, 60)
    return f"{(h - 1) % 12 + 1}:{m:02d} {'am' if h < 12 else 'pm'}"


def _expression(rng: random.Random, expr: str, value: int, *words: str, shown: bool = True) -> _Draft:
    """An arithmetic question: a phrasing in words, or the expression itself when people write it so."""
    plain = ("What is {e}?", "Compute {e}.", "What's {e}? Just the number, please.", "Can you work out {e} for me?")
    text = rng.choice((plain if shown else ()) + words).format(e=expr)
    return text, Fraction(value), {"expr": expr}


def _add(rng):
    a, b = rng.randint(12, 9999), rng.randint(12, 9999)
    return _expression(rng, f"{a} + {b}", a + b, f"Add {a} and {b}.")


def _subtract(rng):
    a, b = sorted((rng.randint(12, 9999), rng.randint(12, 9999)), reverse=True)
    return _expression(rng, f"{a} - {b}", a - b, f"Subtract {b} from {a}.")


def _multiply(rng):
    a, b = rng.randint(12, 999), rng.randint(3, 99)
    return _expression(rng, f"{a} * {b}", a * b, f"What's {a} times {b}?", f"Multiply {a} by {b}.")


def _divide(rng):
    b, q = rng.randint(3, 40), rng.randint(12, 400)
    return _expression(rng, f"{b * q} / {b}", q, f"What is {b * q} divided by {b}?")


def _order_of_operations(rng):
    a, b, c, d = (rng.randint(2, 20) for _ in range(4))
    expr, value = rng.choice(((f"{a} + {b} * {c}", a + b * c), (f"({a} + {b}) * {c} - {d}", (a + b) * c - d),
                              (f"{a} * {b} - {c} * {d}", a * b - c * d), (f"{a} + {b} * ({c} - {d})", a + b * (c - d))))
    return _expression(rng, expr, value, f"Evaluate {expr}, following the order of operations.")


def _power(rng):
    b = rng.randint(2, 12)
    e = rng.randint(2, 6 if b <= 5 else 4)
    return _expression(rng, f"{b} ** {e}", b ** e, f"What is {b} to the power of {e}?", f"What's {b}^{e}?",
                       f"Calculate {b} raised to the power {e}.", shown=False)


def _remainder(rng):
    a, b = rng.randint(100, 9999), rng.randint(3, 50)
    return _expression(rng, f"{a} % {b}", a % b, f"What is the remainder when {a} is divided by {b}?",
                       f"What's left over when you divide {a} by {b}?", shown=False)


def _percent_of(rng):
    p, n = rng.choice((5, 10, 12, 15, 20, 25, 30, 40, 50, 60, 75, 80, 150)), rng.randrange(20, 2001, 10)
    return _pick(rng, "What is {p}% of {n}?", "Calculate {p} percent of {n}.", "How much is {p}% of {n}?",
                 p=p, n=n), Fraction(p * n, 100), {"p": p, "n": n}


def _fraction_of(rng):
    d = rng.randint(3, 12)
    n, x = rng.randint(1, d - 1), d * rng.randint(2, 60)
    return _pick(rng, "What is {n}/{d} of {x}?", "How much is {n}/{d} of {x}?", n=n, d=d, x=x), \
        Fraction(n * x, d), {"n": n, "d": d, "x": x}


def _discount(rng):
    price, p, item = Fraction(rng.randint(10, 400)), rng.choice((10, 15, 20, 25, 30, 40, 50)), rng.choice(_PRICED)
    return _pick(rng, "A {item} costs {m}. It's on sale for {p}% off. What's the sale price in dollars?",
                 "How much does a {m} {item} cost after a {p}% discount?", item=item, m=_money(price), p=p), \
        price * (100 - p) / 100, {"price": price, "p": p}


def _total_cost(rng):
    name, (one, many), q, price = rng.choice(_NAMES), rng.choice(_GOODS), rng.randint(2, 12), \
        Fraction(rng.randrange(50, 1501, 25), 100)
    return _pick(rng, "{name} buys {q} {many} at {m} each. How much does {name} spend in total, in dollars?",
                 "If one {one} costs {m}, how much do {q} of them cost?", name=name, q=q, one=one, many=many,
                 m=_money(price)), q * price, {"q": q, "price": price}


def _change(rng):
    name, (_, many), q, price = rng.choice(_NAMES), rng.choice(_GOODS), rng.randint(2, 6), \
        Fraction(rng.randrange(50, 801, 25), 100)
    bill = next(b for b in (20, 50, 100) if b > q * price)
    return _pick(rng, "{name} buys {q} {many} for {m} each and pays with a ${bill} bill. "
                 "How much change should {name} get back?", name=name, q=q, many=many, m=_money(price),
                 bill=bill), bill - q * price, {"bill": bill, "q": q, "price": price}


def _unit_price(rng):
    q, total = rng.choice((4, 6, 8, 10, 12, 24)), Fraction(rng.randrange(200, 3001, 10), 100)
    return _pick(rng, "A {q}-pack of sparkling water costs {m}. What's the price per can, in dollars?",
                 "If {q} muffins cost {m} altogether, how much is one muffin?", q=q, m=_money(total)), \
        total / q, {"q": q, "total": total}


def _split_bill(rng):
    bill, p, (n, people) = rng.randint(20, 300), rng.choice((10, 15, 20)), rng.choice(((2, "Two"), (4, "Four"),
                                                                                     (5, "Five")))
    return _pick(rng, "{people} friends split a ${bill} dinner bill evenly and add a {p}% tip. "
                 "How much does each person pay?", "A ${bill} restaurant bill plus a {p}% tip is shared "
                 "equally by {n} people. What does each of them pay?", n=n, people=people, bill=bill, p=p), \
        Fraction(bill * (100 + p), 100 * n), {"bill": bill, "p": p, "n": n}


def _average(rng):
    k = rng.choice((4, 5))
    scores = [rng.randint(50, 100) for _ in range(k)]
    return _pick(rng, "What is the average of {s}?", "{name} scored {s} on {k} quizzes. What was the average score?",
                 s=join(scores), name=rng.choice(_NAMES), k=k), Fraction(sum(scores), k), {"values": scores}


def _median(rng):
    values = rng.sample(range(1, 100), rng.choice((5, 6, 7)))
    ordered, k = sorted(values), len(values)
    median = Fraction(ordered[k // 2]) if k % 2 else Fraction(ordered[k // 2 - 1] + ordered[k // 2], 2)
    return _pick(rng, "What is the median of {s}?", "Find the median of these numbers: {s}.", s=join(values)), \
        median, {"values": values}


def _speed(rng):
    speed, t = rng.randint(30, 120), rng.randint(2, 6)
    return _pick(rng, "A train travels {d} km in {t} hours. What is its average speed in km/h?",
                 "A car covers {d} kilometers in {t} hours at a steady speed. How fast is it going, in km/h?",
                 d=speed * t, t=t), Fraction(speed), {"d": speed * t, "t": t}


def _travel_time(rng):
    s, d = rng.choice((10, 12, 15, 20, 24, 30)), rng.randint(2, 40)
    return _pick(rng, "Riding a bike at {s} km/h, how many minutes does it take to cover {d} km?",
                 "If you cycle at a steady {s} km/h, how many minutes will a {d} km ride take?", s=s, d=d), \
        Fraction(d * 60, s), {"s": s, "d": d}


def _area(rng):
    l, w = rng.randint(3, 25), rng.randint(3, 25)
    return _pick(rng, "A room is {l} m long and {w} m wide. What is its floor area in square meters?",
                 "What's the area of a rectangle that is {l} cm by {w} cm?", l=l, w=w), Fraction(l * w), \
        {"l": l, "w": w}


def _fencing(rng):
    l, w = rng.randint(3, 40), rng.randint(3, 40)
    return _pick(rng, "How many meters of fence do I need to go all the way around a rectangular garden that "
                 "is {l} m by {w} m?", "A rectangular field is {l} m long and {w} m wide. What is its perimeter "
                 "in meters?", l=l, w=w), Fraction(2 * (l + w)), {"l": l, "w": w}


def _ages(rng):
    a, b = rng.sample(_NAMES, 2)
    young, gap, years = rng.randint(5, 40), rng.randint(2, 30), rng.randint(2, 10)
    total = 2 * young + gap + 2 * years
    return _pick(rng, "{a} is {gap} years older than {b}. In {years} years, their ages will add up to {total}. "
                 "How old is {b} now?", a=a, b=b, gap=gap, years=years, total=total), Fraction(young), \
        {"gap": gap, "years": years, "total": total}


def _recipe(rng):
    s, g, t = rng.choice((2, 4, 6, 8)), rng.randrange(100, 601, 25), rng.randint(2, 12)
    ingredient = rng.choice(("flour", "sugar", "rice", "butter", "pasta", "oats"))
    return _pick(rng, "A recipe that serves {s} uses {g} grams of {i}. How many grams do I need to serve {t}?",
                 "I'm scaling a recipe from {s} servings to {t}. It calls for {g} g of {i}. How many grams should "
                 "I use?", s=s, g=g, t=t, i=ingredient), Fraction(g * t, s), {"s": s, "g": g, "t": t}


def _minutes_to_hours(rng):
    m = 15 * rng.randint(3, 40)
    return _pick(rng, "How many hours is {m} minutes?", "Convert {m} minutes to hours.", m=m), Fraction(m, 60), \
        {"m": m}


def _unit_conversion(rng):
    (small, big, factor), x = rng.choice((("meters", "kilometers", 1000), ("grams", "kilograms", 1000),
                                          ("centimeters", "meters", 100), ("milliliters", "liters", 1000))), \
        Fraction(rng.randint(5, 200), 10)
    return _pick(rng, "How many {small} are in {x} {big}?", "Convert {x} {big} to {small}.", small=small, big=big,
                 x=format_number(x)), x * factor, {"x": x, "factor": factor}


def _simple_interest(rng):
    p, r, y = rng.randrange(500, 20001, 100), rng.choice((2, 3, 4, 5, 6)), rng.randint(1, 10)
    return _pick(rng, "If you put ${p} in an account that pays {r}% simple interest per year, how much interest "
                 "do you earn in {y} years?", "How much simple interest does ${p} earn at {r}% a year over "
                 "{y} years?", p=p, r=r, y=y), Fraction(p * r * y, 100), {"p": p, "r": r, "y": y}


def _ratio_share(rng):
    a, b = rng.sample(_NAMES, 2)
    x, y = rng.sample(range(1, 8), 2)
    total = (x + y) * rng.randint(5, 200)
    return _pick(rng, "{a} and {b} split ${total} in the ratio {x}:{y}. How much does {a} get?", a=a, b=b,
                 total=total, x=x, y=y), Fraction(total * x, x + y), {"total": total, "x": x, "y": y}


def _overtime(rng):
    name, w, h = rng.choice(_NAMES), rng.randint(12, 40), rng.randint(41, 60)
    return _pick(rng, "{name} earns ${w} an hour, plus time and a half for every hour over 40. How much does "
                 "{name} earn in a {h}-hour week?", name=name, w=w, h=h), \
        Fraction(40 * w) + Fraction(3, 2) * w * (h - 40), {"w": w, "h": h}


def _consecutive(rng):
    middle = rng.randint(5, 300)
    return _pick(rng, "The sum of three consecutive integers is {s}. What is the largest of the three?",
                 "Three consecutive whole numbers add up to {s}. What's the biggest one?", s=3 * middle), \
        Fraction(middle + 1), {"s": 3 * middle}


def _gcd(rng):
    g = rng.randint(2, 30)
    a, b = g * rng.randint(2, 20), g * rng.randint(2, 20)
    return _pick(rng, "What is the greatest common divisor of {a} and {b}?", "Find the GCD of {a} and {b}.",
                 a=a, b=b), Fraction(math.gcd(a, b)), {"a": a, "b": b}


def _lcm(rng):
    a, b = rng.randint(4, 60), rng.randint(4, 60)
    return _pick(rng, "What is the least common multiple of {a} and {b}?", "Find the LCM of {a} and {b}.",
                 a=a, b=b), Fraction(math.lcm(a, b)), {"a": a, "b": b}


def _elapsed(rng):
    start = rng.randrange(7 * 60, 12 * 60, 5)
    end = start + rng.randrange(20, 6 * 60, 5)
    return _pick(rng, "A meeting starts at {s} and ends at {e}. How many minutes long is it?",
                 "A flight leaves at {s} and lands at {e} the same day. How long is the flight in minutes?",
                 s=_clock(start), e=_clock(end)), Fraction(end - start), {"start": start, "end": end}


def _handshakes(rng):
    n = rng.randint(4, 40)
    return _pick(rng, "At a meeting, {n} people each shake hands with everyone else exactly once. How many "
                 "handshakes are there?", "In a league of {n} teams, every team plays every other team once. "
                 "How many games is that?", n=n), Fraction(n * (n - 1) // 2), {"n": n}


def _series_sum(rng):
    n = rng.randint(10, 200)
    return _pick(rng, "What is the sum of all the whole numbers from 1 to {n}?",
                 "Add up every integer from 1 through {n}. What do you get?", n=n), Fraction(n * (n + 1) // 2), \
        {"n": n}


def _percent_change(rng):
    old, p, up = rng.randrange(20, 501, 20), rng.choice((5, 10, 20, 25, 40, 50)), rng.random() < 0.5
    new = Fraction(old * (100 + p if up else 100 - p), 100)
    return _pick(rng, "The price of a {item} went from ${old} to {new}. By what percent did it go {way}?",
                 item=rng.choice(_PRICED), old=old, new=_money(new), way="up" if up else "down"), Fraction(p), \
        {"old": old, "new": new}


def _reading_pace(rng):
    name, d, k = rng.choice(_NAMES), rng.randint(3, 30), rng.randint(5, 60)
    return _pick(rng, "{name} wants to finish a {p}-page book in {d} days. How many pages a day is that?",
                 name=name, p=d * k, d=d), Fraction(k), {"p": d * k, "d": d}


def _fuel(rng):
    rate, d = Fraction(rng.randint(9, 18), 2), rng.randrange(50, 901, 10)
    return _pick(rng, "A car uses {r} liters of fuel per 100 km. How many liters does it need for a {d} km trip?",
                 r=format_number(rate), d=d), rate * d / 100, {"rate": rate, "d": d}


def _savings(rng):
    name, s, w = rng.choice(_NAMES), rng.randrange(5, 101, 5), rng.randint(3, 52)
    return _pick(rng, "{name} saves ${s} every week. How many weeks will it take to save ${goal}?",
                 "If I put away ${s} a week, how many weeks until I have ${goal}?", name=name, s=s, goal=s * w), \
        Fraction(w), {"s": s, "goal": s * w}


MATH: dict[str, Callable[[random.Random], _Draft]] = {
    "add": _add, "subtract": _subtract, "multiply": _multiply, "divide": _divide,
    "order of operations": _order_of_operations, "power": _power, "remainder": _remainder,
    "percent of": _percent_of, "fraction of": _fraction_of, "discount": _discount, "total cost": _total_cost,
    "change": _change, "unit price": _unit_price, "split bill": _split_bill, "average": _average,
    "median": _median, "speed": _speed, "travel time": _travel_time, "area": _area, "fencing": _fencing,
    "ages": _ages, "recipe": _recipe, "minutes to hours": _minutes_to_hours, "unit conversion": _unit_conversion,
    "simple interest": _simple_interest, "ratio share": _ratio_share, "overtime": _overtime,
    "consecutive integers": _consecutive, "gcd": _gcd, "lcm": _lcm, "elapsed time": _elapsed,
    "handshakes": _handshakes, "series sum": _series_sum, "percent change": _percent_change,
    "reading pace": _reading_pace, "fuel": _fuel, "savings": _savings,
}
