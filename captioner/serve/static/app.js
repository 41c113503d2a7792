// The captioner page: send a photo to /api/caption, show the caption as word chips, and draw the
// chosen word's attention map over the photo (maps.js draws it as the PNG pictures do). A caption
// typed into the text box is sent along (`text`): the chips are then those words, each with its
// log-probability, and the maps where the model looked for them.
import { heat, jet, upsample } from "./maps.js";

const $ = (id) => document.getElementById(id);
const state = { model: null, result: null, file: null, current: -1, timer: null, url: null };

// --- drawing -------------------------------------------------------------------------------------

function draw() {
  const canvas = $("overlay"), photo = $("photo"), r = state.result;
  if (!r || !photo.naturalWidth) return;
  const scale = Math.min(window.devicePixelRatio || 1, 2);
  const width = Math.max(1, Math.min(720, Math.round(photo.clientWidth * scale)));
  const height = Math.max(1, Math.round(width * photo.naturalHeight / photo.naturalWidth));
  canvas.width = width;
  canvas.height = height;
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, width, height);
  if (state.current < 0) { canvas.setAttribute("aria-label", "no word chosen"); return; }
  const map = r.attention[state.current], regions = r.grid[0] * r.grid[1];
  const weights = upsample(map, width, height, r.cells);
  const opacity = Number($("opacity").value);
  const image = ctx.createImageData(width, height);
  for (let i = 0; i < weights.length; i++) {
    const h = heat(weights[i], regions), [red, green, blue] = jet(h);
    image.data.set([red, green, blue, Math.round(255 * opacity * h)], i * 4);
  }
  ctx.putImageData(image, 0, 0);
  canvas.setAttribute("aria-label", describe(state.current));
}

function where(map) {  // "the top left", ... of the map's largest cell
  let best = [0, 0];
  map.forEach((row, i) => row.forEach((v, j) => { if (v > map[best[0]][best[1]]) best = [i, j]; }));
  const third = (k, n) => (n < 2 ? 1 : Math.min(2, Math.floor((3 * k) / n)));
  const vertical = ["top", "middle", "bottom"][third(best[0], map.length)];
  const horizontal = ["left", "centre", "right"][third(best[1], map[0].length)];
  return vertical === "middle" && horizontal === "centre" ? "the centre" : `the ${vertical} ${horizontal}`;
}

function describe(t) {
  const r = state.result, f = r.focus[t], regions = r.grid[0] * r.grid[1];
  const times = (f.peak * regions).toFixed(1);
  const spread = f.spread > 0.9 ? "spread over the whole photo" : `strongest at ${where(r.attention[t])}`;
  const likely = r.word_logprobs ? `; log-probability ${r.word_logprobs[t].toFixed(2)}` : "";
  return `"${r.tokens[t]}": peak weight ${f.peak.toFixed(2)} (${times}x an even spread), ${spread}${likely}`;
}

function choose(t) {
  state.current = t;
  document.querySelectorAll(".word").forEach((chip, i) => chip.setAttribute("aria-pressed", String(i === t)));
  $("focus-text").textContent = t >= 0 ? describe(t) : "";
  draw();
}

function drawScale(regions) {
  const canvas = $("scale"), ctx = canvas.getContext("2d");
  for (let x = 0; x < canvas.width; x++) {
    const [red, green, blue] = jet(x / (canvas.width - 1));
    ctx.fillStyle = `rgb(${red},${green},${blue})`;
    ctx.fillRect(x, 0, 1, canvas.height);
  }
  const ticks = $("ticks");
  ticks.replaceChildren();
  for (const m of [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, regions].filter((m) => m <= regions)) {
    if (m !== regions && m * 2 > regions) continue;  // keep "all" readable
    const span = document.createElement("span");
    span.style.left = `${(100 * Math.log(m)) / Math.log(Math.max(regions, 2))}%`;
    span.textContent = m === regions ? "all" : `${m}x`;
    ticks.append(span);
  }
}

// --- the answer ----------------------------------------------------------------------------------

function show(result) {
  state.result = result;
  const words = $("words");
  words.replaceChildren();
  result.tokens.forEach((word, t) => {
    const chip = document.createElement("button");
    chip.type = "button";
    chip.className = "word";
    chip.setAttribute("aria-pressed", "false");
    chip.setAttribute("aria-label", describe(t));
    chip.append(word);
    const figure = document.createElement("small");  // a given word: how likely; else how sharp its map
    figure.textContent = result.word_logprobs ? result.word_logprobs[t].toFixed(2) : result.focus[t].peak.toFixed(2);
    chip.append(figure);
    chip.addEventListener("mouseenter", () => choose(t));
    chip.addEventListener("focus", () => choose(t));
    chip.addEventListener("click", () => choose(t));
    words.append(chip);
  });
  const list = $("alternative-list");
  list.replaceChildren(...(result.alternatives || []).map((a) => {
    const item = document.createElement("li");
    item.textContent = `${a.caption} (score ${a.score.toFixed(2)})`;
    return item;
  }));
  $("alternatives-box").hidden = !(result.alternatives || []).length;
  drawScale(result.grid[0] * result.grid[1]);
  const ms = Math.round(result.seconds * 1000);
  $("status").className = "";
  $("status").textContent = result.word_logprobs
    ? `Your words “${result.caption}”: log-probability ${result.logprob.toFixed(2)} in all, the end included (${ms} ms)`
    : `“${result.caption}” (score ${result.score.toFixed(2)}, ${ms} ms)`;
  $("words-legend").textContent = result.word_logprobs
    ? "Each word with its log-probability: hover or focus it to see where the model looked for it."
    : "Each word with its map's peak weight: hover or focus it to see where the model looked.";
  $("result").hidden = false;
  choose(-1);
}

function fail(message) {  // the sentence, and no words or map of an earlier answer beside it
  stop();
  state.result = null;
  state.current = -1;
  $("words").replaceChildren();
  $("focus-text").textContent = $("words-legend").textContent = "";
  $("alternatives-box").hidden = true;
  const overlay = $("overlay");
  overlay.getContext("2d").clearRect(0, 0, overlay.width, overlay.height);
  overlay.setAttribute("aria-label", "no word chosen");
  $("status").className = "error";
  $("status").textContent = message;
  $("result").hidden = false;
}

function options() {
  const d = state.model ? state.model.decode : { beam_size: 3 };
  const beam = Number($("beam").value) || d.beam_size;
  const params = new URLSearchParams({ beam: String(beam) });
  if ($("max-length").value) params.set("max_length", $("max-length").value);
  if (!userText()) params.set("alternatives", String(Math.min(Number($("alternatives").value) || 0, beam - 1)));
  return params;
}

function userText() { return $("text").value.trim(); }

async function post(path, file) {
  const form = new FormData();
  form.append("image", file, file.name || "image");
  if (userText()) form.append("text", userText());
  return fetch(`${path}?${options()}`, { method: "POST", body: form });
}

async function caption(file) {
  if (!file) return;
  stop();
  state.file = file;
  if (state.url) URL.revokeObjectURL(state.url);
  state.url = URL.createObjectURL(file);
  $("photo").src = state.url;
  $("status").className = "";
  $("status").textContent = "captioning…";
  try {
    const response = await post("/api/caption", file);
    const body = await response.json();
    if (!response.ok) return fail(body.error || `error ${response.status}`);
    show(body);
  } catch (e) {
    fail(`the server could not be reached (${e.message})`);
  }
}

// --- controls ------------------------------------------------------------------------------------

function stop() {
  clearInterval(state.timer);
  state.timer = null;
  $("play").textContent = "▶ play";
}

function play() {
  if (state.timer) return stop();
  const n = state.result ? state.result.tokens.length : 0;
  if (!n) return;
  $("play").textContent = "■ stop";
  choose(state.current >= n - 1 ? 0 : state.current + 1);
  state.timer = setInterval(() => {
    if (state.current >= n - 1) return stop();
    choose(state.current + 1);
  }, 900);
}

function keys(event) {
  const chips = [...document.querySelectorAll(".word")];
  const at = chips.indexOf(document.activeElement);
  if (at < 0) return;
  const next = { ArrowRight: at + 1, ArrowDown: at + 1, ArrowLeft: at - 1, ArrowUp: at - 1, Home: 0,
                 End: chips.length - 1 }[event.key];
  if (next === undefined) return;
  event.preventDefault();
  chips[Math.max(0, Math.min(chips.length - 1, next))].focus();
}

function download(name, blob) {
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = name;
  a.click();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

async function downloadPicture() {
  if (!state.file) return;
  const response = await post("/api/visualize", state.file);
  if (!response.ok) return fail((await response.json()).error);
  download("caption.png", await response.blob());
}

async function start() {
  const drop = $("drop");
  $("file").addEventListener("change", (e) => caption(e.target.files[0]));
  drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (e) => {
    e.preventDefault();
    drop.classList.remove("over");
    caption(e.dataTransfer.files[0]);
  });
  drop.addEventListener("keydown", (e) => { if (e.key === "Enter" || e.key === " ") $("file").click(); });
  document.addEventListener("paste", (e) => {
    const file = [...(e.clipboardData ? e.clipboardData.files : [])].find((f) => f.type.startsWith("image/"));
    if (file) caption(file);
  });
  $("words").addEventListener("keydown", keys);
  document.addEventListener("keydown", (e) => { if (e.key === "Escape") { stop(); choose(-1); } });
  $("play").addEventListener("click", play);
  $("opacity").addEventListener("input", draw);
  $("photo").addEventListener("load", draw);
  new ResizeObserver(draw).observe($("photo"));
  $("download-json").addEventListener("click", () => {
    if (state.result) download("caption.json", new Blob([JSON.stringify(state.result, null, 1)], { type: "application/json" }));
  });
  $("download-png").addEventListener("click", downloadPicture);
  $("text-form").addEventListener("submit", (e) => {
    e.preventDefault();
    if (state.file) caption(state.file);
    else fail("choose an image first");
  });
  $("text-clear").addEventListener("click", () => {
    $("text").value = "";
    if (state.file) caption(state.file);
  });

  const model = await (await fetch("/api/model")).json();
  state.model = model;
  $("model").textContent = `${model.encoder} at ${model.image_size} px, a ${model.grid[0]}x${model.grid[1]} grid, ` +
    `${model.vocabulary} words; beam ${model.decode.beam_size}`;
  $("beam").placeholder = model.decode.beam_size;
  $("max-length").placeholder = model.decode.max_length;
  for (const name of model.examples) {
    const button = document.createElement("button");
    button.type = "button";
    button.setAttribute("aria-label", `Example: ${name.replace(/\.[a-z]+$/i, "").replace(/[-_]/g, " ")}`);
    const img = document.createElement("img");
    img.src = `/examples/${encodeURIComponent(name)}`;
    img.alt = "";
    button.append(img);
    button.addEventListener("click", async () => {
      const blob = await (await fetch(img.src)).blob();
      caption(new File([blob], name, { type: blob.type }));
    });
    $("examples").append(button);
  }
}

start();
