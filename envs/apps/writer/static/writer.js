// Writer's menus, dialogs, tabs and selection commands. The server renders every menu,
// dialog and tab panel hidden; this script only shows and hides them, so the
// accessibility tree holds exactly what a person sees.
(function () {
  "use strict";
  const message = document.getElementById("message");
  const text = document.getElementById("text");

  // Report a dialog or tab panel the page now shows. Synchronous on purpose: the click
  // that opened it returns only after the server recorded it, so a checker reading the
  // state right after the click never races the report.
  function report(surface) {
    const xhr = new XMLHttpRequest();
    xhr.open("POST", "/surfaces", false);
    xhr.setRequestHeader("Content-Type", "application/x-www-form-urlencoded");
    xhr.send("surface=" + encodeURIComponent(surface));
  }

  function say(words) { if (message) message.textContent = words; }

  function setMenu(button, open) {
    button.setAttribute("aria-expanded", String(open));
    document.getElementById(button.getAttribute("aria-controls")).hidden = !open;
    if (!open) {  // a closed menu closes its submenus
      document.getElementById(button.getAttribute("aria-controls"))
        .querySelectorAll("[aria-haspopup=menu]").forEach((b) => setMenu(b, false));
    }
  }

  function closeMenus() {
    document.querySelectorAll(".menubar > .menu-wrap > [aria-haspopup=menu]").forEach((b) => setMenu(b, false));
  }

  function nameOf(dialog) { return document.getElementById(dialog.getAttribute("aria-labelledby")).textContent; }

  function openDialog(id) {
    document.querySelectorAll("[role=dialog]").forEach((d) => { d.hidden = true; });
    const dialog = document.getElementById("dialog-" + id);
    dialog.hidden = false;
    report(nameOf(dialog));
    const first = dialog.querySelector("input:not([type=hidden]), [role=tab], button");
    if (first) first.focus();
  }

  function selectTab(tab) {
    tab.closest("[role=tablist]").querySelectorAll("[role=tab]").forEach((t) => {
      const chosen = t === tab;
      t.setAttribute("aria-selected", String(chosen));
      document.getElementById(t.getAttribute("aria-controls")).hidden = !chosen;
    });
    report(tab.textContent);
  }

  // Commands that act on a selection refuse without one, as a desktop editor's do.
  function wrapSelection(mark) {
    if (text.selectionStart === text.selectionEnd) { say("Select some text first."); return; }
    const [start, end] = [text.selectionStart, text.selectionEnd];
    text.setRangeText(mark + text.value.slice(start, end) + mark, start, end, "select");
    say("");
  }

  const commands = {
    "bold": () => wrapSelection("**"),
    "italic": () => wrapSelection("_"),
    "select-all": () => { text.focus(); text.select(); },
    "delete": () => {
      const chosen = document.querySelector("[role=option][aria-selected=true]");
      if (!chosen) { say("Select a document in the list first."); return; }
      const dialog = document.getElementById("dialog-delete");
      dialog.querySelector("input[name=id]").value = chosen.dataset.id;
      dialog.querySelector(".confirm").textContent = "Delete “" + chosen.textContent + "”?";
      openDialog("delete");
    },
  };

  document.addEventListener("click", (event) => {
    const target = event.target.closest("button, [role=option]");
    if (!target) { closeMenus(); return; }
    if (target.getAttribute("aria-haspopup") === "menu") {
      const open = target.getAttribute("aria-expanded") !== "true";
      if (target.closest(".menubar > .menu-wrap > button") === target) closeMenus();
      setMenu(target, open);
      return;
    }
    if (target.getAttribute("role") === "option") {
      target.parentElement.querySelectorAll("[role=option]").forEach((o) => o.setAttribute("aria-selected", "false"));
      target.setAttribute("aria-selected", "true");
      return;
    }
    if (target.getAttribute("role") === "tab") { selectTab(target); return; }
    if (target.hasAttribute("data-close")) { target.closest("[role=dialog]").hidden = true; return; }
    if (target.getAttribute("role") === "menuitem") closeMenus();
    if (target.dataset.dialog) openDialog(target.dataset.dialog);
    else if (target.dataset.command) commands[target.dataset.command]();
    else if (target.dataset.href) window.location.assign(target.dataset.href);
  });

  // The shortcuts Help > Keyboard shortcuts lists. Ctrl+S submits the editor's form itself rather than clicking
  // the toolbar's Save: a click would be reported by the interaction recorder as one the user never made.
  const shortcuts = {
    "s": () => document.getElementById("editor").requestSubmit(),
    "b": commands.bold,
    "i": commands.italic,
  };

  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape") {
      closeMenus();
      document.querySelectorAll("[role=dialog]").forEach((d) => { d.hidden = true; });
      return;
    }
    const shortcut = shortcuts[event.key.toLowerCase()];
    if (!event.ctrlKey || event.altKey || event.metaKey || !shortcut) return;
    event.preventDefault();  // the browser's own Ctrl+S (save the page) and Ctrl+B/I (bookmarks, page info)
    shortcut();
  });
})();
