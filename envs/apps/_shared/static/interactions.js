// The bundled apps' interaction recorder, served by every app server as /__kit/interactions.js.
//
// It tells the server what low-level operation the user did on which element, so a checker
// can judge an atomic-operation task (double-click this word, drag that card) from server
// state instead of the screen. Each report is {op, role, name, text?, to_role?, to_name?,
// page, at}, in the vocabulary of query_gen.operations.Operation, POSTed to /__ui with
// navigator.sendBeacon: a beacon outlives the page, so a click that navigates still lands.
// Beacons may arrive out of order; `at` (ms since the epoch, sub-millisecond) says when
// each happened. On a user's app the browser itself keeps the reports: there the page has
// window.__trajforgeReport (a CDP binding, envs.browser.BrowserEnv.add_recorder), which is
// called instead; its call reaches the browser before the page can unload, as a beacon does.
//
// Elements are named as the accessibility tree names them, as closely as plain JS can tell:
// the nearest element with a nameable role (a link, a button, a labelled field, a heading...)
// named by aria-label, its <label>, or its rendered text; text outside any of those is role
// "text" named by its text node, as Chromium's tree shows StaticText.
(() => {
  "use strict";
  // One recorder a page: a bundled app's page loads it, and a user's app gets it from the browser (envs.appdir).
  if (window.__trajforgeRecorder) return;
  window.__trajforgeRecorder = true;

  const TAG_ROLES = {
    button: "button", textarea: "textbox", select: "combobox", img: "image",
    h1: "heading", h2: "heading", h3: "heading", h4: "heading", h5: "heading", h6: "heading",
  };
  const INPUT_ROLES = {
    checkbox: "checkbox", radio: "radio", search: "searchbox", number: "spinbutton", range: "slider",
    submit: "button", button: "button", reset: "button", image: "button", hidden: null,
  };
  // Explicit roles that name an element a task can aim at; landmarks and live regions are not.
  const NAMEABLE = new Set(["link", "button", "checkbox", "radio", "switch", "textbox", "searchbox",
    "spinbutton", "slider", "combobox", "tab", "menuitem", "option", "heading", "image", "img"]);

  const clean = (s) => (s || "").replace(/\s+/g, " ").trim();

  function roleOf(el) {
    const explicit = (el.getAttribute("role") || "").split(" ")[0];
    if (explicit) return NAMEABLE.has(explicit) ? (explicit === "img" ? "image" : explicit) : null;
    const tag = el.localName;
    if (tag === "a") return el.hasAttribute("href") ? "link" : null;
    if (tag === "input") {
      const type = (el.getAttribute("type") || "text").toLowerCase();
      return type in INPUT_ROLES ? INPUT_ROLES[type] : "textbox";
    }
    return TAG_ROLES[tag] || null;
  }

  function nameOf(el, role) {
    const label = el.getAttribute("aria-label");
    if (label) return clean(label);
    const by = el.getAttribute("aria-labelledby");
    if (by) return clean(by.split(/\s+/).map((id) => document.getElementById(id)?.innerText || "").join(" "));
    if (el.labels && el.labels.length) return clean([...el.labels].map((l) => l.innerText).join(" "));
    if (role === "image") return clean(el.getAttribute("alt"));
    if (el.localName === "input") return clean(role === "button" ? el.value : el.placeholder || el.title);
    return clean(el.innerText || el.textContent);  // innerText: rendered text, as the tree has it
  }

  // {role, name} of a node (an element or a text node) as the accessibility tree would name it.
  function describe(node) {
    const start = node.nodeType === Node.TEXT_NODE ? node.parentElement : node;
    for (let el = start; el && el !== document.documentElement; el = el.parentElement) {
      const role = roleOf(el);
      if (role) return { role, name: nameOf(el, role) };
    }
    if (node.nodeType === Node.TEXT_NODE) return { role: "text", name: clean(node.data) };
    return { role: "generic", name: "" };
  }

  // The text node under a point, when the point is on its glyphs; otherwise the element there.
  function nodeAt(x, y) {
    const caret = document.caretRangeFromPoint(x, y);
    const text = caret && caret.startContainer;
    if (text && text.nodeType === Node.TEXT_NODE && clean(text.data)) {
      const range = document.createRange();
      range.selectNodeContents(text);
      for (const r of range.getClientRects()) {
        if (x >= r.left && x <= r.right && y >= r.top && y <= r.bottom) return text;
      }
    }
    return document.elementFromPoint(x, y) || document.body;
  }

  function report(events) {
    const page = location.pathname + location.search;
    const at = performance.timeOrigin + performance.now();
    const body = JSON.stringify(events.map((e) => ({ ...e, page, at })));
    if (window.__trajforgeReport) window.__trajforgeReport(body);
    else navigator.sendBeacon("/__ui", body);
  }

  function selected() {
    const sel = getSelection();
    if (!sel || sel.isCollapsed || !sel.rangeCount) return null;
    return { text: clean(sel.toString()), node: sel.getRangeAt(0).commonAncestorContainer };
  }

  addEventListener("click", (e) => {
    // detail 0: a click without a pointer (a <label> passing its click on, Enter on a button).
    const where = e.detail === 0 ? e.target : nodeAt(e.clientX, e.clientY);
    if (e.button === 0 && e.detail <= 1) report([{ op: "click", ...describe(where) }]);
  }, true);

  addEventListener("dblclick", (e) => {
    const sel = selected();  // a double-click on text selects the word under it
    const where = sel ? sel.node : nodeAt(e.clientX, e.clientY);
    report([{ op: "double_click", ...describe(where), ...(sel ? { text: sel.text } : {}) }]);
  }, true);

  addEventListener("contextmenu", (e) => {
    report([{ op: "right_click", ...describe(nodeAt(e.clientX, e.clientY)) }]);
  }, true);

  // A press and a release apart: a selection when it selected text, else a pointer drag.
  let down = null;
  addEventListener("mousedown", (e) => {
    down = e.button === 0 ? { x: e.clientX, y: e.clientY, node: nodeAt(e.clientX, e.clientY) } : null;
  }, true);
  addEventListener("mouseup", (e) => {
    if (!down || e.button !== 0 || Math.hypot(e.clientX - down.x, e.clientY - down.y) < 5) return;
    const sel = selected();
    if (sel && sel.text) {
      report([{ op: "select_text", ...describe(sel.node), text: sel.text }]);
    } else {
      const to = describe(nodeAt(e.clientX, e.clientY));
      report([{ op: "drag", ...describe(down.node), to_role: to.role, to_name: to.name }]);
    }
    down = null;
  }, true);

  // HTML drag and drop (a dragged link or card): reported where it is dropped, or where the
  // drag ended when nothing took the drop. Capturing listeners run before the page's own.
  let dragged = null;
  let over = null;
  addEventListener("dragstart", (e) => { dragged = describe(e.target); down = null; }, true);
  addEventListener("dragover", (e) => { over = { x: e.clientX, y: e.clientY }; }, true);
  function dropped(x, y) {
    if (!dragged) return;
    const to = describe(nodeAt(x, y));
    report([{ op: "drag", ...dragged, to_role: to.role, to_name: to.name }]);
    dragged = null;
  }
  addEventListener("drop", (e) => dropped(e.clientX, e.clientY), true);
  addEventListener("dragend", (e) => dropped(over ? over.x : e.clientX, over ? over.y : e.clientY), true);

  // Typing: the field and its whole value after each edit (the server keeps the last one). A
  // password field's value is reported as bullets, as the screen and Chromium's tree show it:
  // the app's state goes into every episode row (final_state_json), a password must not.
  addEventListener("input", (e) => {
    const el = e.target;
    const role = roleOf(el);
    if (role === "textbox" || role === "searchbox" || role === "spinbutton") {
      const text = el.type === "password" ? "\u2022".repeat(el.value.length) : el.value;
      report([{ op: "type_at", role, name: nameOf(el, role), text }]);
    }
  }, true);

  // Scrolling: elements that come into view (at least half visible) after the page has
  // loaded; what was visible at load is not reported.
  const initial = new WeakSet();
  const shown = new WeakSet();
  const observer = new IntersectionObserver((entries) => {
    const came = [];
    for (const entry of entries) {
      const el = entry.target;
      const visible = entry.intersectionRatio >= 0.5;
      if (!initial.has(el)) {
        initial.add(el);
        if (visible) shown.add(el);
      } else if (visible && !shown.has(el)) {
        shown.add(el);
        const role = roleOf(el);
        came.push({ op: "scroll_to", role, name: nameOf(el, role) });
      }
    }
    if (came.length) report(came);
  }, { threshold: 0.5 });

  function observe() {
    for (const el of document.querySelectorAll("a[href], button, input, textarea, select, img, h1, h2, h3, h4, h5, h6, [role]")) {
      if (roleOf(el)) observer.observe(el);
    }
  }
  if (document.readyState === "loading") addEventListener("DOMContentLoaded", observe);
  else observe();
})();
