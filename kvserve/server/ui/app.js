// The page's start: find the served model (asking for the API key if the server wants one),
// then wire the two views, Chat and Engine, to the tabs.

import { api, AuthError, setKey } from "./api.js";
import { Chat } from "./chat.js";
import { EngineView } from "./engine.js";

const $ = (id) => document.getElementById(id);

let asking = null; // the key dialog's promise while it is open

// Ask for the API key until the server accepts one; resolves with the model list.
function askKey() {
  if (asking) return asking;
  const dialog = $("key-dialog");
  const input = $("api-key");
  $("key-error").textContent = "";
  asking = new Promise((resolve) => {
    $("key-form").onsubmit = async (e) => {
      e.preventDefault();
      setKey(input.value.trim());
      try {
        const models = await loadModels();
        input.value = "";
        dialog.close();
        asking = null;
        resolve(models);
      } catch (err) {
        $("key-error").textContent = err instanceof AuthError ? "The server did not accept this key." : err.message;
        input.select();
      }
    };
  });
  if (!dialog.open) dialog.showModal();
  input.focus();
  return asking;
}

async function loadModels() {
  const res = await api("/v1/models");
  return (await res.json()).data.map((m) => m.id);
}

function showView(name) {
  $("key-dialog").addEventListener("cancel", (e) => e.preventDefault()); // Escape: the key is still needed
for (const tab of document.querySelectorAll("[data-view]")) {
    const active = tab.dataset.view === name;
    tab.classList.toggle("active", active);
    tab.setAttribute("aria-selected", String(active));
    $(`view-${tab.dataset.view}`).hidden = !active;
  }
  if (name === "engine" && !document.hidden) engine.start();
  else engine.stop();
  if (name === "chat") $("prompt").focus();
}

const onAuthError = () => askKey().then(() => {
  if (!$("view-engine").hidden) engine.start();
});
const chat = new Chat({ onAuthError });
const engine = new EngineView({ onAuthError });

for (const tab of document.querySelectorAll("[data-view]")) tab.addEventListener("click", () => showView(tab.dataset.view));
document.addEventListener("visibilitychange", () => {
  // a tab in the background does not keep the engine busy with live views nobody sees
  if (document.hidden) engine.stop();
  else if (!$("view-engine").hidden) engine.start();
});

async function boot() {
  let models;
  try {
    const config = await (await api("/ui/config")).json();
    models = config.api_key_required ? await askKey() : await loadModels();
  } catch (e) {
    $("model-name").textContent = `server unavailable: ${e.message}`;
    return;
  }
  chat.model = models[0];
  $("model-name").textContent = models[0];
  $("model-name").title = `served as: ${models.join(", ")}`;
  document.body.classList.add("ready");
  showView(location.hash === "#engine" ? "engine" : "chat");
}

boot();
