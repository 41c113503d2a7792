// The captioner page: send a photo to /api/caption, show the caption as word chips, and draw the
// chosen word's attention map over the photo.
//
// A map (rows x cols weights summing to 1) is drawn as captioner.pictures.overlay draws it in the
// PNG pictures: each weight sits at its cell's receptive-field centre (origin + j * stride, as a
// fraction of the image side), upsampled bicubically between the centres (torch grid_sample's
// kernel, A = -0.75, edge cells repeated), then coloured on one fixed scale for every word: log of
// the weight as a multiple of the even share 1/L, from 0 (even or less: clear) to 1 (all on one
// cell), with opacity following it.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { model: null, result: null, file: null, current: -1, timer: null, url: null };

// --- colours ----------------------------------------------------------------------------------

// matplotlib's "jet" segment data: [x, value] points per channel.
const JET = [
  [[0, 0], [0.35, 0], [0.66, 1], [0.89, 1], [1, 0.5]],
  [[0, 0], [0.125, 0], [0.375, 1], [0.64, 1], [0.91, 0], [1, 0]],
  [[0, 0.5], [0.11, 1], [0.34, 1], [0.65, 0], [1, 0]],
];

function channel(points, v) {
  for (let i = 1; i < points.length; i++) {
    const [x0, y0] = points[i - 1], [x1, y1] = points[i];
    if (v <= x1) return y0 + (y1 - y0) * (v - x0) / (x1 - x0);
  }
  return points[points.length - 1][1];
}

function jet(v) { return JET.map((points) => Math.round(255 * channel(points, v))); }

function heat(weight, regions) {
  if (regions <= 1) return 1;
  return Math.min(1, Math.max(0, Math.log(Math.max(weight * regions, 1e-12)) / Math.log(regions)));
}

// --- upsampling at the cells' centres ------------------------------------------------------------

function cubic(t) {  // weights of the 4 taps at offsets -1, 0, 1, 2 (Keys, A = -0.75)
  const A = -0.75;
  const near = (x) => ((A + 2) * x - (A + 3)) * x * x + 1;
  const far = (x) => ((A * x - 5 * A) * x + 8 * A) * x - 4 * A;
  return [far(t + 1), near(t), near(1 - t), far(2 - t)];
}

function taps(n, pixels, cells) {  // per pixel: 4 cell indices and 4 weights along one side
  const index = new Int32Array(pixels * 4), weight = new Float32Array(pixels * 4);
  for (let p = 0; p < pixels; p++) {
    const c = n > 1 ? ((p + 0.5) / pixels - cells.origin) / cells.stride : 0;  // fractional cell index
    const f = Math.floor(c), w = cubic(c - f);
    for (let k = 0; k < 4; k++) {
      index[p * 4 + k] = Math.min(n - 1, Math.max(0, f - 1 + k));
      weight[p * 4 + k] = w[k];
    }
  }
  return { index, weight };
}

// (rows x cols) map -> Float32Array(width * height) of weights per cell, clipped at 0.
function upsample(map, width, height, cells) {
  const rows = map.length, cols = map[0].length;
  const cx = cells || { origin: 0.5 / cols, stride: 1 / cols };
  const cy = cells || { origin: 0.5 / rows, stride: 1 / rows };
  const tx = taps(cols, width, cx), ty = taps(rows, height, cy);
  const across = new Float32Array(height * cols);  // rows interpolated first
  for (let y = 0; y < height; y++) {
    for (let c = 0; c < cols; c++) {
      let s = 0;
      for (let k = 0; k < 4; k++) s += ty.weight[y * 4 + k] * map[ty.index[y * 4 + k]][c];
      across[y * cols + c] = s;
    }
  }
  const out = new Float32Array(width * height);
  for (let y = 0; y < height; y++) {
    for (let x = 0; x < width; x++) {
      let s = 0;
      for (let k = 0; k < 4; k++) s += tx.weight[x * 4 + k] * across[y * cols + tx.index[x * 4 + k]];
      out[y * width + x] = Math.max(0, s);
    }
  }
  return out;
}

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
  return `"${r.tokens[t]}": peak weight ${f.peak.toFixed(2)} (${times}x an even spread), ${spread}`;
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
    const peak = document.createElement("small");
    peak.textContent = result.focus[t].peak.toFixed(2);
    chip.append(peak);
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
  $("status").className = "";
  $("status").textContent = `“${result.caption}” (score ${result.score.toFixed(2)}, ${Math.round(result.seconds * 1000)} ms)`;
  $("result").hidden = false;
  choose(-1);
}

function fail(message) {
  $("status").className = "error";
  $("status").textContent = message;
  $("result").hidden = false;
}

function options() {
  const d = state.model ? state.model.decode : { beam_size: 3 };
  const beam = Number($("beam").value) || d.beam_size;
  const params = new URLSearchParams({ beam: String(beam) });
  if ($("max-length").value) params.set("max_length", $("max-length").value);
  params.set("alternatives", String(Math.min(Number($("alternatives").value) || 0, beam - 1)));
  return params;
}

async function post(path, file) {
  const form = new FormData();
  form.append("image", file, file.name || "image");
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
