"""FreshCart: a small food-delivery shop, the first bundled app.

Pages: home (dishes, Search, Settings), search, dish (size, quantity, Add to cart),
cart (Checkout), checkout (delivery address, payment, Place order), confirmation,
settings (Order notifications, Save) and "Settings saved". Everything is a real form
or link, validated on the server, so an agent's mistakes have real consequences
(an empty address is refused with a message, not silently accepted).

Session state (what checkers read):
    {"cart": [{"dish", "size", "quantity"}],
     "orders": [{"number", "lines": [{"dish", "size", "quantity"}], "address", "payment", "total_cents"}],
     "settings": {"order_notifications": bool}, "settings_saves": int}
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlencode

from trajforge.envs.apps.base import BundledApp
from trajforge.envs.apps.kit import alert, document, esc, missing, norm
from trajforge.envs.apps.web import Request, Response, not_found, redirect

SIZES: dict[str, int] = {"Small": -200, "Medium": 0, "Large": 300}
"""Size label -> price change in cents against the dish's medium price."""

PAYMENTS = ("Card", "Cash")

DISHES: dict[str, tuple[str, int]] = {
    "Margherita Pizza": ("Tomato, mozzarella and fresh basil on a thin crust.", 1100),
    "Pad Thai": ("Rice noodles with tofu, peanuts, bean sprouts and lime.", 1050),
    "Chicken Burrito": ("Grilled chicken, rice, black beans and salsa in a flour tortilla.", 950),
    "Caesar Salad": ("Romaine, parmesan, croutons and a creamy garlic dressing.", 850),
    "Miso Ramen": ("Wheat noodles in miso broth with corn, egg and spring onion.", 1250),
    "Falafel Wrap": ("Crispy falafel, hummus, pickles and tahini in flatbread.", 800),
}
"""Dish name -> (description, medium price in cents). Names are the accessible link names."""

INITIAL_STATE: dict[str, Any] = {
    "cart": [],
    "orders": [],
    "settings": {"order_notifications": True},
    "settings_saves": 0,
}

MAX_QUANTITY = 10


def _money(cents: int) -> str:
    return f"${cents / 100:.2f}"


def _price(dish: str, size: str) -> int:
    return DISHES[dish][1] + SIZES[size]


def _dish_url(dish: str) -> str:
    """The dish page: the spec's `/dish/{dish}` with the name percent-encoded."""
    return "/dish/" + quote(dish)


def _page(title: str, body: str, state: dict[str, Any], status: int = 200) -> Response:
    count = sum(line["quantity"] for line in state["cart"])
    header = ('<header>\n<nav aria-label="Main"><a class="brand" href="/">FreshCart</a>'
              f'<a class="cart-link" href="/cart">Cart ({count})</a></nav>\n</header>')
    return document(title, "FreshCart", body, status=status, header=header)


def _dish_list(dishes: list[str]) -> str:
    items = "".join(
        f'<li><a href="{esc(_dish_url(d))}">{esc(d)}</a>'
        f'<p>{esc(DISHES[d][0])}</p><p class="price">from {_money(_price(d, "Small"))}</p></li>'
        for d in dishes
    )
    return f'<ul class="dishes">{items}</ul>'


def _line_text(line: dict[str, Any]) -> str:
    return f"{line['quantity']} × {line['size']} {line['dish']}"


class ShopApp(BundledApp):
    """The FreshCart server-side app; see the module docstring for pages and state."""

    def __init__(self) -> None:
        super().__init__("shop", Path(__file__).parent)
        self.checkers = {
            "in_cart": check_in_cart,
            "order_placed": check_order_placed,
            "notifications_set": check_notifications_set,
        }

    def initial_state(self) -> dict[str, Any]:
        return copy.deepcopy(INITIAL_STATE)

    def handle(self, request: Request, state: dict[str, Any]) -> Response:
        path, method = request.path, request.method
        if method == "GET":
            if path == "/":
                return self._home(state)
            if path == "/search":
                return self._search(state, request.query.get("q", ""))
            if path.startswith("/dish/"):
                return self._dish(state, unquote(path.removeprefix("/dish/")))
            if path == "/cart":
                return self._cart(state)
            if path == "/checkout":
                return self._checkout(state)
            if path == "/confirmation":
                return self._confirmation(state, request.query.get("order", ""))
            if path == "/settings":
                return self._settings(state)
            if path == "/settings/saved":
                return self._settings_saved(state)
        elif method == "POST":
            if path == "/cart/add":
                return self._add_to_cart(state, request.form)
            if path == "/cart/remove":
                return self._remove_from_cart(state, request.form)
            if path == "/checkout/begin":
                return redirect("/checkout")  # a button, and the checkout page's URL stays clean
            if path == "/checkout":
                return self._place_order(state, request.form)
            if path == "/settings":
                return self._save_settings(state, request.form)
        return not_found(f"{method} {path}")

    # --- pages -----------------------------------------------------------------

    def _home(self, state: dict[str, Any]) -> Response:
        body = f"""<h1>Order food</h1>
<p class="links"><a href="/search">Search</a><a href="/settings">Settings</a></p>
<h2>Dishes</h2>
{_dish_list(list(DISHES))}"""
        return _page("Home", body, state)

    def _search(self, state: dict[str, Any], q: str) -> Response:
        results = ""
        if q.strip():
            words = norm(q).split()
            found = [d for d in DISHES if all(w in norm(f"{d} {DISHES[d][0]}") for w in words)]
            listing = _dish_list(found) if found else "<p>No dishes match your search.</p>"
            results = f"<h2>Results for “{esc(q.strip())}”</h2>{listing}"
        body = f"""<h1>Search</h1>
<form role="search" method="get" action="/search">
<label for="q">Search dishes</label>
<div class="row"><input type="search" id="q" name="q" value="{esc(q)}"><button type="submit">Search</button></div>
</form>
{results}"""
        return _page("Search", body, state)

    def _dish(self, state: dict[str, Any], dish: str, error: str | None = None,
              chosen: str | None = None, quantity: str = "1") -> Response:
        if dish not in DISHES:
            return not_found(f"no dish called {dish!r}")
        options = "".join(
            f'<div class="option"><input type="radio" id="size-{s.lower()}" name="size" value="{s}"'
            f'{" checked" if s == chosen else ""}><label for="size-{s.lower()}">{s}</label>'
            f'<span class="price">{_money(_price(dish, s))}</span></div>'
            for s in SIZES
        )
        body = f"""<h1>{esc(dish)}</h1>
<p>{esc(DISHES[dish][0])}</p>
{alert(error)}
<form method="post" action="/cart/add">
<input type="hidden" name="dish" value="{esc(dish)}">
<fieldset><legend>Size</legend>{options}</fieldset>
<p class="field"><label for="quantity">Quantity</label>
<input type="number" id="quantity" name="quantity" value="{esc(quantity)}" min="1" max="{MAX_QUANTITY}"></p>
<button type="submit">Add to cart</button>
</form>"""
        return _page(dish, body, state, 400 if error else 200)

    def _cart(self, state: dict[str, Any]) -> Response:
        if not state["cart"]:
            body = '<h1>Your cart</h1><p>Your cart is empty.</p><p><a href="/">Browse dishes</a></p>'
            return _page("Cart", body, state)
        lines = "".join(
            f'<li><span>{esc(_line_text(line))}</span><span class="price">'
            f'{_money(_price(line["dish"], line["size"]) * line["quantity"])}</span>'
            f'<form method="post" action="/cart/remove"><input type="hidden" name="index" value="{i}">'
            f'<button type="submit" class="secondary" aria-label="Remove {esc(line["size"])} '
            f'{esc(line["dish"])}">Remove</button></form></li>'
            for i, line in enumerate(state["cart"])
        )
        total = sum(_price(line["dish"], line["size"]) * line["quantity"] for line in state["cart"])
        body = f"""<h1>Your cart</h1>
<ul class="lines">{lines}</ul>
<p class="total">Total: {_money(total)}</p>
<form method="post" action="/checkout/begin"><button type="submit">Checkout</button></form>"""
        return _page("Cart", body, state)

    def _checkout(self, state: dict[str, Any], error: str | None = None, address: str = "",
                  payment: str | None = None) -> Response:
        if not state["cart"]:
            body = f'<h1>Checkout</h1>{alert(error)}<p>Your cart is empty.</p><p><a href="/">Browse dishes</a></p>'
            return _page("Checkout", body, state, 400 if error else 200)
        summary = "".join(f"<li>{esc(_line_text(line))}</li>" for line in state["cart"])
        payments = "".join(
            f'<div class="option"><input type="radio" id="pay-{p.lower()}" name="payment" value="{p}"'
            f'{" checked" if p == payment else ""}><label for="pay-{p.lower()}">{p}</label></div>'
            for p in PAYMENTS
        )
        body = f"""<h1>Checkout</h1>
<ul class="summary">{summary}</ul>
{alert(error)}
<form method="post" action="/checkout">
<p class="field"><label for="address">Delivery address</label>
<input type="text" id="address" name="address" value="{esc(address)}" autocomplete="street-address"></p>
<fieldset><legend>Payment</legend>{payments}</fieldset>
<button type="submit">Place order</button>
</form>"""
        return _page("Checkout", body, state, 400 if error else 200)

    def _confirmation(self, state: dict[str, Any], number: str) -> Response:
        order = next((o for o in state["orders"] if o["number"] == number), None)
        if order is None:
            return not_found(f"no order {number!r}")
        lines = "".join(f"<li>{esc(_line_text(line))}</li>" for line in order["lines"])
        body = f"""<h1>Order placed</h1>
<p>Order number <strong>{esc(order["number"])}</strong></p>
<ul class="summary">{lines}</ul>
<p>Delivering to {esc(order["address"])}, paying by {esc(order["payment"].lower())}.</p>
<p>Total: {_money(order["total_cents"])}</p>
<p><a href="/">Back to home</a></p>"""
        return _page("Order placed", body, state)

    def _settings(self, state: dict[str, Any]) -> Response:
        checked = " checked" if state["settings"]["order_notifications"] else ""
        body = f"""<h1>Settings</h1>
<form method="post" action="/settings">
<div class="option"><input type="checkbox" id="order-notifications" name="order_notifications" value="on"{checked}>
<label for="order-notifications">Order notifications</label></div>
<button type="submit">Save</button>
</form>"""
        return _page("Settings", body, state)

    def _settings_saved(self, state: dict[str, Any]) -> Response:
        value = "on" if state["settings"]["order_notifications"] else "off"
        body = f"""<h1>Settings saved</h1>
<p>Order notifications are {value}.</p>
<p><a href="/">Back to home</a></p>"""
        return _page("Settings saved", body, state)

    # --- form posts --------------------------------------------------------------

    def _add_to_cart(self, state: dict[str, Any], form: dict[str, str]) -> Response:
        dish, size, quantity = form.get("dish", ""), form.get("size", ""), form.get("quantity", "1")
        if dish not in DISHES:
            return not_found(f"no dish called {dish!r}")
        if size not in SIZES:
            return self._dish(state, dish, "Choose a size.", quantity=quantity)
        try:
            qty = int(quantity)
        except ValueError:
            qty = 0
        if not 1 <= qty <= MAX_QUANTITY:
            return self._dish(state, dish, f"Quantity must be a whole number from 1 to {MAX_QUANTITY}.",
                              chosen=size, quantity=quantity)
        for line in state["cart"]:
            if line["dish"] == dish and line["size"] == size:
                line["quantity"] = min(MAX_QUANTITY, line["quantity"] + qty)
                break
        else:
            state["cart"].append({"dish": dish, "size": size, "quantity": qty})
        return redirect("/cart")

    def _remove_from_cart(self, state: dict[str, Any], form: dict[str, str]) -> Response:
        index = form.get("index", "")
        # isdecimal, not isdigit: "²" is a digit int() refuses, and the post answered 500.
        if index.isdecimal() and int(index) < len(state["cart"]):
            del state["cart"][int(index)]
        return redirect("/cart")

    def _place_order(self, state: dict[str, Any], form: dict[str, str]) -> Response:
        address = " ".join(form.get("address", "").split())
        payment = form.get("payment")
        if not state["cart"]:
            return self._checkout(state, "Your cart is empty; add a dish first.")
        if not address:
            return self._checkout(state, "Enter a delivery address.", address, payment)
        if len(address) > 200:
            return self._checkout(state, "The delivery address is too long.", address, payment)
        if payment not in PAYMENTS:
            return self._checkout(state, "Choose a payment method.", address, payment)
        number = f"FC-{1001 + len(state['orders'])}"
        state["orders"].append({
            "number": number,
            "lines": copy.deepcopy(state["cart"]),
            "address": address,
            "payment": payment,
            "total_cents": sum(_price(li["dish"], li["size"]) * li["quantity"] for li in state["cart"]),
        })
        state["cart"].clear()
        return redirect("/confirmation?" + urlencode({"order": number}))

    def _save_settings(self, state: dict[str, Any], form: dict[str, str]) -> Response:
        state["settings"]["order_notifications"] = form.get("order_notifications") == "on"
        state["settings_saves"] += 1
        return redirect("/settings/saved")


# --- checkers: they read the session state, never the screen ----------------------


def _wanted(params: dict[str, str]) -> tuple[dict[str, Any] | None, str]:
    """The one line a goal asks for: `dish` in `size`, `quantity` of it (1 where the goal names none); or None and
    why. A task that orders one dish is not done by an order that holds it among others or ten of it."""
    if problem := missing(params, "dish", "size"):
        return None, problem
    quantity = params.get("quantity") or "1"
    if not quantity.isdecimal():
        return None, f"checker param quantity must be a whole number, got {quantity!r}"
    return {"dish": params["dish"], "size": params["size"], "quantity": int(quantity)}, ""


def _exactly(lines: list[dict[str, Any]], want: dict[str, Any]) -> bool:
    """The lines are the wanted line and nothing else (case and spacing of the names aside)."""
    return (len(lines) == 1 and norm(lines[0]["dish"]) == norm(want["dish"])
            and norm(lines[0]["size"]) == norm(want["size"]) and lines[0]["quantity"] == want["quantity"])


def _lines_text(lines: list[dict[str, Any]]) -> str:
    return "; ".join(_line_text(li) for li in lines) or "nothing"


def check_in_cart(params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
    """The cart holds exactly `dish` in `size`, `quantity` of it (1 unless given), and nothing else."""
    want, problem = _wanted(params)
    if want is None:
        return False, problem
    cart = state.get("cart", [])
    if _exactly(cart, want):
        return True, f"cart holds {_line_text(want)}"
    return False, f"the cart should hold just {_line_text(want)}; it holds {_lines_text(cart)}"


def check_order_placed(params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
    """An order holds exactly `dish` in `size`, `quantity` of it (1 unless given), goes to `address` and is paid
    by `payment`."""
    if problem := missing(params, "dish", "size", "address", "payment"):
        return False, problem
    want, problem = _wanted(params)
    if want is None:
        return False, problem
    orders = state.get("orders", [])
    if not orders:
        return False, "no order was placed"
    reasons = []
    for order in orders:
        wrong = []
        if not _exactly(order["lines"], want):
            wrong.append(f"lines {_lines_text(order['lines'])}")
        if norm(order["address"]) != norm(params["address"]):
            wrong.append(f"address {order['address']!r}")
        if norm(order["payment"]) != norm(params["payment"]):
            wrong.append(f"payment {order['payment']}")
        if not wrong:
            return True, (f"order {order['number']}: {_line_text(want)} to "
                          f"{order['address']!r}, paid by {order['payment']}")
        reasons.append(f"order {order['number']} has {', '.join(wrong)}")
    return False, (f"no order of just {_line_text(want)} to {params['address']!r} paid by "
                   f"{params['payment']}: " + "; ".join(reasons))


def check_notifications_set(params: dict[str, str], state: dict[str, Any]) -> tuple[bool, str]:
    """Order notifications are `on` or `off`, and the settings were saved at least once."""
    if problem := missing(params, "notifications"):
        return False, problem
    want = norm(params["notifications"])
    if want not in ("on", "off"):
        return False, f"checker param notifications must be 'on' or 'off', got {params['notifications']!r}"
    actual = "on" if state.get("settings", {}).get("order_notifications") else "off"
    saves = state.get("settings_saves", 0)
    if saves == 0:
        return False, f"settings were never saved (order notifications are {actual})"
    if actual != want:
        return False, f"order notifications are {actual}, not {want}"
    return True, f"order notifications are {actual} (settings saved {saves} time(s))"


def create_app() -> ShopApp:
    return ShopApp()
