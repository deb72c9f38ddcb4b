// Jotter: move a note card by dragging its title onto another card of the same list; the
// card takes that card's place. The order is the server's: the drop posts the hidden
// "move" form, a real navigation like every other change in the bundled apps.
(() => {
  "use strict";
  let moving = null;
  const cardOf = (target) => (target instanceof Element ? target.closest("ul.cards li[data-id]") : null);
  const accepts = (card) => moving !== null && card !== null && card !== moving
    && card.parentElement === moving.parentElement;

  document.addEventListener("dragstart", (e) => {
    moving = cardOf(e.target);
    if (moving) e.dataTransfer.effectAllowed = "move";
  });
  document.addEventListener("dragover", (e) => {
    if (accepts(cardOf(e.target))) e.preventDefault();  // allow the drop here
  });
  document.addEventListener("drop", (e) => {
    const card = cardOf(e.target);
    if (!accepts(card)) return;
    e.preventDefault();
    const form = document.getElementById("move");
    form.elements.id.value = moving.dataset.id;
    form.elements.to.value = card.dataset.id;
    form.submit();
  });
  document.addEventListener("dragend", () => { moving = null; });
})();
