// The console's little script (no build step): confirm before lifting a quarantine, and copy a
// tool form's call into the raw JSON box ("as JSON") to edit it there.
"use strict";
document.addEventListener("DOMContentLoaded", () => {
  for (const button of document.querySelectorAll("button.lift")) {
    button.addEventListener("click", (event) => {
      if (!window.confirm("Let this environment be sampled again?")) event.preventDefault();
    });
  }
  const raw = document.getElementById("raw");
  if (!raw) return;
  for (const form of document.querySelectorAll("form.tool-form")) {
    const copy = document.createElement("button");
    copy.type = "button";
    copy.textContent = "as JSON";
    copy.addEventListener("click", () => {
      const parameters = {};
      for (const input of form.querySelectorAll("[name^='p.']")) {
        const name = input.name.slice(2);
        if (input.type === "checkbox") { parameters[name] = input.checked; continue; }
        if (input.value === "") continue;
        try { parameters[name] = JSON.parse(input.value); } catch { parameters[name] = input.value; }
      }
      raw.value = JSON.stringify({ name: form.dataset.tool, parameters });
      raw.focus();
    });
    form.querySelector("fieldset").appendChild(copy);
  }
});
