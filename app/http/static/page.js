// The page's only script: try a model on an image, and watch how the models share memory.
// It speaks to this service's own routes and nothing else (the Content-Security-Policy allows
// no other origin): /models, /models/<name>/detect, /models/<name>/detect/video, /gpu, /gpu/history,
// and the repository extension's /v2/repository/models/<name>/load and /unload.
"use strict";

const POLL_MS = 2000;
const COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
const OTHER_COLOUR = "#9aa5b1";
const SERVER_COLOUR = "#5a6570";

const $ = (id) => document.getElementById(id);
const state = {
  image: null,        // {blob, url, name} of the image on show
  models: [],         // /models' rows
  history: new Map(), // series key -> {kind, name, samples: [[unix, mib, source, state], ...]}
  historySince: null, // unix time of the newest sample held
  keepS: 600,
  offsetS: 0,         // server clock minus this clock, from /gpu/history's now_unix
  colours: new Map(),
  detecting: 0,       // which detect request is the latest; older answers are dropped
  busy: new Set(),    // models with a load or unload in flight from this page
};

// ---------------------------------------------------------------------------------------------
// Talking to the service

class ServiceError extends Error {}

async function call(method, path, body, contentType) {
  let response;
  try {
    const init = { method, headers: { Accept: "application/json" } };
    if (body !== undefined) {
      init.body = body;
      init.headers["Content-Type"] = contentType || "application/octet-stream";
    }
    response = await fetch(path, init);
  } catch (err) {
    throw new ServiceError(`the service did not answer (${err.message || err})`);
  }
  const text = await response.text();
  let answer = null;
  try {
    answer = text ? JSON.parse(text) : null;
  } catch (err) {
    answer = null;
  }
  if (!response.ok) {
    throw new ServiceError(`Error ${response.status}: ${errorMessage(answer, text)}`);
  }
  if (answer === null && text) {
    throw new ServiceError(`${method} ${path} answered ${response.status} with something other than JSON`);
  }
  return answer;  // null for an empty answer (the repository extension's load and unload)
}

function errorMessage(answer, text) {
  // Every protocol's error shape: ours {"error": {"message"}}, KServe v2 {"error": "..."}, TF Serving's too.
  if (answer && typeof answer.error === "object" && answer.error !== null && answer.error.message) {
    return answer.error.message;
  }
  if (answer && typeof answer.error === "string") return answer.error;
  return (text || "no message").slice(0, 300);
}

// ---------------------------------------------------------------------------------------------
// Helpers

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "className") node.className = value;
    else if (key === "text") node.textContent = value;
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function mib(value) {
  if (value === null || value === undefined) return "–";
  if (value >= 10240) return `${(value / 1024).toFixed(1)} GiB`;
  return `${Math.round(value)} MiB`;
}

function colourOf(key) {
  if (!state.colours.has(key)) {
    if (key === "server") state.colours.set(key, SERVER_COLOUR);
    else if (key === "spares") state.colours.set(key, OTHER_COLOUR);
    else state.colours.set(key, COLOURS[state.colours.size % COLOURS.length]);
  }
  return state.colours.get(key);
}

function showError(box, message) {
  box.textContent = message;
  box.hidden = !message;
}

// ---------------------------------------------------------------------------------------------
// Try a model

function chosenModel() {
  return $("model").value;
}

function threshold() {
  return Number($("threshold").value).toFixed(2);
}

function fillModels(listing) {
  const select = $("model");
  const before = select.value;
  const names = listing.models.map((m) => m.name);
  const same = names.length === select.options.length && names.every((n, i) => select.options[i].value === n);
  if (!same) {
    select.replaceChildren(...names.map((name) => el("option", { value: name, text: name })));
    const preferred = names.includes(before) ? before : (listing.default_model || names[0] || "");
    select.value = preferred;
  }
  select.disabled = names.length === 0;
  if (names.length === 0) select.replaceChildren(el("option", { value: "", text: "no models are served" }));
  showLabels();
}

// What the chosen model finds, from its label map (known once it has loaded).
function showLabels() {
  const model = state.models.find((m) => m.name === chosenModel());
  const labels = (model && model.labels) || [];
  $("model-labels").textContent = labels.length === 0 ? "" :
    `${model.name} finds ${labels.length === 1 ? "one label" : `${labels.length} labels`}: ${labels.join(", ")}`;
}

function takeImage(file) {
  if (!file) return;
  if (file.type && !file.type.startsWith("image/")) {
    showError($("error"), `${file.name || "that file"} is not an image (${file.type})`);
    return;
  }
  if (state.image) URL.revokeObjectURL(state.image.url);
  state.image = { blob: file, url: URL.createObjectURL(file), name: file.name || "pasted image" };
  detect();
}

async function detect() {
  const image = state.image;
  const model = chosenModel();
  if (!image || !model) return;
  const mine = ++state.detecting;
  showError($("error"), "");
  $("status").textContent = `Asking ${model} about ${image.name}…`;
  const path = `/models/${encodeURIComponent(model)}/detect?threshold=${threshold()}`;
  try {
    const answer = await call("POST", path, image.blob, image.blob.type || "application/octet-stream");
    if (mine !== state.detecting) return;
    await showAnswer(image, answer);
    const count = answer.detections.length;
    $("status").textContent = `${answer.model.name} v${answer.model.version} found ${count} ` +
      `${count === 1 ? "object" : "objects"} at threshold ${threshold()}.`;
  } catch (err) {
    if (mine !== state.detecting) return;
    $("status").textContent = "";
    showError($("error"), err instanceof ServiceError ? err.message : `the page failed: ${err.message || err}`);
  }
}

function showAnswer(image, answer) {
  const photo = $("photo");
  $("result").hidden = false;
  return new Promise((resolve) => {
    const draw = () => {
      drawBoxes(answer);
      listDetections(answer);
      resolve();
    };
    if (photo.dataset.src === image.url && photo.complete) {
      draw();
      return;
    }
    photo.onload = draw;
    photo.onerror = () => { drawBoxes(answer); listDetections(answer); resolve(); };
    photo.dataset.src = image.url;
    photo.alt = `${image.name}, with what ${answer.model.name} found boxed`;
    photo.src = image.url;
  });
}

function drawBoxes(answer) {
  // Boxes are in the pixels of the upright image (EXIF applied), as the browser shows it; placing them
  // in percent keeps them on the image at any displayed size.
  const boxes = $("boxes");
  boxes.replaceChildren();
  for (const [i, d] of answer.detections.entries()) {
    const b = d.box;
    const box = el("div", { className: "box", "data-index": i, "aria-hidden": "true" },
      el("span", { className: "box-label", text: `${d.label} ${d.score.toFixed(2)}` }));
    box.style.left = `${(100 * b.x_min) / answer.width}%`;
    box.style.top = `${(100 * b.y_min) / answer.height}%`;
    box.style.width = `${(100 * (b.x_max - b.x_min)) / answer.width}%`;
    box.style.height = `${(100 * (b.y_max - b.y_min)) / answer.height}%`;
    if (b.y_min < 0.08 * answer.height) box.classList.add("low");
    boxes.append(box);
  }
  const t = answer.timing_ms || {};
  const parts = [`decode ${t.decode} ms`];
  if (t.load !== undefined) parts.push(`load ${t.load} ms (the model was not loaded)`);
  parts.push(`inference ${t.inference} ms`, `total ${t.total} ms`);
  $("timing").textContent = `${answer.width}×${answer.height} px · ${parts.join(" · ")}`;
}

function listDetections(answer) {
  const items = answer.detections.map((d) => el("li", {},
    el("span", { className: "label", text: d.label }), " ",
    el("span", { className: "score", text: d.score.toFixed(3) }), " at ",
    `(${Math.round(d.box.x_min)}, ${Math.round(d.box.y_min)})–(${Math.round(d.box.x_max)}, ${Math.round(d.box.y_max)})`));
  if (items.length === 0) items.push(el("li", { className: "none", text: "nothing above the threshold" }));
  $("detections").replaceChildren(...items);
}

function wireTryPanel() {
  const drop = $("drop");
  $("file").addEventListener("change", (event) => takeImage(event.target.files[0]));
  drop.addEventListener("dragover", (event) => { event.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (event) => {
    event.preventDefault();
    drop.classList.remove("over");
    takeImage(event.dataTransfer.files[0]);
  });
  document.addEventListener("paste", (event) => {
    const item = [...(event.clipboardData?.items || [])].find((i) => i.kind === "file" && i.type.startsWith("image/"));
    if (item) {
      event.preventDefault();
      takeImage(item.getAsFile());
    }
  });
  $("threshold").addEventListener("input", () => { $("threshold-value").textContent = threshold(); });
  $("threshold").addEventListener("change", detect);
  $("model").addEventListener("change", () => { showLabels(); detect(); });
}

// ---------------------------------------------------------------------------------------------
// Camera and video: the chosen model on the camera's live picture, one frame in flight, each object with
// a track number; or a video file the server decodes and tracks (POST /models/<name>/detect/video),
// drawn over the file as it plays. Boxes take their class's colour, the same as in the server's
// pictures and videos (app/vision/annotate.py's PALETTE).

const CLASS_COLOURS = [
  "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f",
  "#393b79", "#e6550d", "#31a354", "#ad494a", "#6b6ecf", "#8c6d31", "#ce6dbd", "#3182bd", "#a55194", "#637939",
];
const CAMERA_SIDE = 640;     // camera frames are sent at most this wide or high
const TRACK_LOW = 0.1;       // detections this sure may keep a track alive (the server's ByteTrack's second stage)
const TRACK_LOST_MS = 1000;  // a track unseen this long ends
const BOX_KEYS = ["x_min", "y_min", "x_max", "y_max"];
const camera = {
  session: 0,       // which run is current: a camera run or a video file; older ones stop
  stream: null,     // the camera's MediaStream
  tracker: null,
  answered: [],     // when each of the last answers came (ms), for the rate
  records: [],      // a video file's frame records, in order
  info: null,       // its video record
  done: false,      // its answer has ended
  waiting: false,   // its playback waits for the answer to catch up
  fileUrl: null,
};

function classColour(classId) {
  return CLASS_COLOURS[(((classId - 1) % CLASS_COLOURS.length) + CLASS_COLOURS.length) % CLASS_COLOURS.length];
}

function cameraMessage(text, isError) {
  if (isError) {
    showError($("camera-error"), text);
    $("camera-status").textContent = "";
  } else {
    showError($("camera-error"), "");
    $("camera-status").textContent = text;
  }
}

// A small tracker for the camera's frames, which reach the server one by one: each track's box is predicted
// by its last step, then matched to the sure detections by IoU and class, then to the unsure ones (ByteTrack's
// two stages, without its Kalman filter). A video file is tracked by the server's own ByteTrack instead.
class PageTracker {
  constructor(high) {
    this.high = high;
    this.tracks = [];
    this.nextId = 1;
  }

  update(detections, now) {
    for (const t of this.tracks) t.predicted = shift(t.box, t.step);
    const sure = detections.filter((d) => d.score >= this.high);
    const unsure = detections.filter((d) => d.score < this.high);
    const given = new Map();
    const free = this.match(this.tracks, sure, 0.2, given, now);
    this.match(free.filter((t) => now - t.seen <= TRACK_LOST_MS / 4), unsure, 0.5, given, now);
    for (const d of sure) {
      if (given.has(d) || d.score < Math.min(this.high + 0.1, 1)) continue;
      const track = { id: this.nextId++, classId: d.class_id, box: d.box, step: [0, 0, 0, 0], seen: now };
      this.tracks.push(track);
      given.set(d, track.id);
    }
    this.tracks = this.tracks.filter((t) => now - t.seen <= TRACK_LOST_MS);
    return detections.filter((d) => given.has(d) || d.score >= this.high)
      .map((d) => ({ ...d, track_id: given.has(d) ? given.get(d) : null }));
  }

  match(tracks, detections, least, given, now) {
    const pairs = [];
    for (const t of tracks) {
      for (const d of detections) {
        if (d.class_id !== t.classId || given.has(d)) continue;
        const similarity = iou(t.predicted, d.box);
        if (similarity >= least) pairs.push([similarity, t, d]);
      }
    }
    pairs.sort((a, b) => b[0] - a[0]);
    const taken = new Set();
    for (const [, t, d] of pairs) {
      if (taken.has(t) || given.has(d)) continue;
      taken.add(t);
      given.set(d, t.id);
      t.step = BOX_KEYS.map((k, i) => 0.5 * t.step[i] + 0.5 * (d.box[k] - t.box[k]));  // a smoothed step per frame
      t.box = d.box;
      t.seen = now;
    }
    return tracks.filter((t) => !taken.has(t));
  }
}

function shift(box, step) {
  return { x_min: box.x_min + step[0], y_min: box.y_min + step[1], x_max: box.x_max + step[2], y_max: box.y_max + step[3] };
}

function iou(a, b) {
  const w = Math.max(0, Math.min(a.x_max, b.x_max) - Math.max(a.x_min, b.x_min));
  const h = Math.max(0, Math.min(a.y_max, b.y_max) - Math.max(a.y_min, b.y_min));
  const inter = w * h;
  const union = (a.x_max - a.x_min) * (a.y_max - a.y_min) + (b.x_max - b.x_min) * (b.y_max - b.y_min) - inter;
  return union > 0 ? inter / union : 0;
}

function drawTracked(detections, width, height) {
  // Boxes are in the pixels of the picture the answer is about (width x height); the canvas covers the video
  // as shown, at the device's pixel ratio.
  const video = $("camera-video");
  const canvas = $("camera-canvas");
  const ratio = window.devicePixelRatio || 1;
  const shownW = video.clientWidth, shownH = video.clientHeight;
  canvas.width = Math.round(shownW * ratio);
  canvas.height = Math.round(shownH * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, shownW, shownH);
  if (!width || !height) return;
  const sx = shownW / width, sy = shownH / height;
  ctx.lineWidth = 2;
  ctx.font = "600 13px system-ui, sans-serif";
  ctx.textBaseline = "bottom";
  for (const d of [...detections].sort((a, b) => a.score - b.score)) {
    const b = d.box;
    const x = b.x_min * sx, y = b.y_min * sy, w = (b.x_max - b.x_min) * sx, h = (b.y_max - b.y_min) * sy;
    const colour = classColour(d.class_id);
    ctx.strokeStyle = colour;
    ctx.strokeRect(x, y, w, h);
    const text = `${d.track_id === null ? "" : `#${d.track_id} `}${d.label} ${d.score.toFixed(2)}`;
    const tagW = ctx.measureText(text).width + 8;
    const tagY = y >= 18 ? y : y + 18;
    ctx.fillStyle = colour;
    ctx.fillRect(x, tagY - 18, tagW, 18);
    ctx.fillStyle = "#ffffff";
    ctx.fillText(text, x + 4, tagY - 3);
  }
  $("camera-tracks").replaceChildren(...detections.map((d) => el("li", { "data-track": d.track_id === null ? "" : d.track_id },
    el("span", { className: "label", text: d.track_id === null ? "new" : `#${d.track_id}` }), " ",
    `${d.label} `, el("span", { className: "score", text: d.score.toFixed(3) }))));
}

function newSession() {
  camera.session += 1;
  if (camera.stream) {
    for (const track of camera.stream.getTracks()) track.stop();
    camera.stream = null;
  }
  const video = $("camera-video");
  video.pause();
  video.srcObject = null;
  if (camera.fileUrl) {
    video.removeAttribute("src");
    video.load();
    URL.revokeObjectURL(camera.fileUrl);
    camera.fileUrl = null;
  }
  camera.answered = [];
  camera.records = [];
  camera.info = null;
  camera.done = false;
  camera.waiting = false;
  $("camera-stop").disabled = true;
  return camera.session;
}

async function startCamera() {
  const session = newSession();
  const model = chosenModel();
  if (!model) return;
  if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) {
    cameraMessage("This browser gives no camera to this page (a camera needs https:// or localhost).", true);
    return;
  }
  try {
    camera.stream = await navigator.mediaDevices.getUserMedia({ video: { width: { ideal: 1280 } }, audio: false });
  } catch (err) {
    cameraMessage(`The camera could not be opened: ${err.message || err.name || err}`, true);
    return;
  }
  if (session !== camera.session) return;
  const video = $("camera-video");
  video.srcObject = camera.stream;
  $("camera-stage").hidden = false;
  $("camera-stop").disabled = false;
  await video.play().catch(() => {});
  camera.tracker = new PageTracker(Number(threshold()));
  cameraMessage(`Asking ${model} about the camera's frames…`);
  cameraLoop(session, model);
}

async function cameraLoop(session, model) {
  // One frame in flight: the next is taken when the answer to the last has come, so the page runs at the rate
  // the server keeps up with, and shows that rate.
  const video = $("camera-video");
  const grab = document.createElement("canvas");
  let frames = 0;
  while (session === camera.session) {
    if (video.readyState < 2 || !video.videoWidth) {
      await new Promise((resolve) => setTimeout(resolve, 50));
      continue;
    }
    const scale = Math.min(1, CAMERA_SIDE / Math.max(video.videoWidth, video.videoHeight));
    grab.width = Math.round(video.videoWidth * scale);
    grab.height = Math.round(video.videoHeight * scale);
    grab.getContext("2d").drawImage(video, 0, 0, grab.width, grab.height);
    const blob = await new Promise((resolve) => grab.toBlob(resolve, "image/jpeg", 0.85));
    let answer;
    try {
      const low = Math.min(TRACK_LOW, Number(threshold())).toFixed(2);
      answer = await call("POST", `/models/${encodeURIComponent(model)}/detect?threshold=${low}`, blob, "image/jpeg");
    } catch (err) {
      if (session !== camera.session) return;
      cameraMessage(err.message, true);
      await new Promise((resolve) => setTimeout(resolve, 1000));  // a busy or failed server: try again shortly
      continue;
    }
    if (session !== camera.session) return;
    const now = performance.now();
    camera.answered.push(now);
    while (camera.answered.length && now - camera.answered[0] > 3000) camera.answered.shift();
    const rate = camera.answered.length > 1 ?
      (1000 * (camera.answered.length - 1)) / (now - camera.answered[0]) : 0;
    const tracked = camera.tracker.update(answer.detections, now);
    drawTracked(tracked, answer.width, answer.height);
    frames += 1;
    document.body.dataset.cameraFrames = String(frames);
    cameraMessage(`${answer.model.name} v${answer.model.version}: ${rate.toFixed(1)} frames/s, one frame in flight; ` +
      `${tracked.length} ${tracked.length === 1 ? "object" : "objects"} in view.`);
  }
}

function stopCamera() {
  newSession();
  cameraMessage("Stopped.");
}

async function trackVideoFile(file) {
  if (!file) return;
  const session = newSession();
  const model = chosenModel();
  if (!model) return;
  const video = $("camera-video");
  camera.fileUrl = URL.createObjectURL(file);
  video.src = camera.fileUrl;
  $("camera-stage").hidden = false;
  $("camera-stop").disabled = false;
  cameraMessage(`Sending ${file.name} to ${model}…`);
  let response;
  try {
    response = await fetch(`/models/${encodeURIComponent(model)}/detect/video?threshold=${threshold()}`, {
      method: "POST", body: file,
      headers: { "Content-Type": file.type || "application/octet-stream", Accept: "application/x-ndjson" },
    });
  } catch (err) {
    cameraMessage(`the service did not answer (${err.message || err})`, true);
    return;
  }
  if (!response.ok) {
    const text = await response.text();
    let answer = null;
    try { answer = JSON.parse(text); } catch (err) { answer = null; }
    if (session === camera.session) cameraMessage(`Error ${response.status}: ${errorMessage(answer, text)}`, true);
    return;
  }
  video.play().catch(() => {});
  followVideo(session);
  await readRecords(session, response.body.getReader(), file.name);
}

async function readRecords(session, reader, name) {
  // The answer is NDJSON, a record per line, read as it comes: the first frames are drawn while the server is
  // still on the later ones.
  const decoder = new TextDecoder();
  let held = "";
  for (;;) {
    let chunk;
    try {
      chunk = await reader.read();
    } catch (err) {
      if (session === camera.session) cameraMessage(`The answer was cut: ${err.message || err}`, true);
      return;
    }
    if (session !== camera.session) {
      reader.cancel().catch(() => {});
      return;
    }
    if (chunk.done) break;
    held += decoder.decode(chunk.value, { stream: true });
    let end;
    while ((end = held.indexOf("\n")) >= 0) {
      const line = held.slice(0, end);
      held = held.slice(end + 1);
      if (line.trim()) takeRecord(JSON.parse(line), name);
    }
  }
}

function takeRecord(record, name) {
  if (record.video) {
    camera.info = record.video;
  } else if (record.frame !== undefined) {
    camera.records.push(record);
    document.body.dataset.videoFrames = String(camera.records.length);
    const total = camera.info ? Math.ceil(camera.info.duration_s * camera.info.sampled_fps) : "?";
    cameraMessage(`${name}: ${camera.records.length} of about ${total} frames tracked…`);
  } else if (record.end) {
    camera.done = true;
    document.body.dataset.videoDone = "true";
    cameraMessage(`${name}: ${record.end.frames} frames, ${record.end.tracks} ` +
      `${record.end.tracks === 1 ? "track" : "tracks"}, tracked in ${(record.end.timing_ms.total / 1000).toFixed(1)} s.`);
  } else if (record.error) {
    camera.done = true;
    cameraMessage(`${name} stopped after ${record.frames} frames: ${record.error.message}`, true);
  }
}

function followVideo(session) {
  // On every animation frame, draw the tracks of the last frame answered at or before the picture shown. While
  // the answer is behind the picture, the video waits for it, so that the boxes stay on their objects.
  const video = $("camera-video");
  const draw = () => {
    if (session !== camera.session) return;
    const now = video.currentTime + 1e-3;
    const records = camera.records;
    const last = records.length ? records[records.length - 1] : null;
    if (!camera.done && !video.paused && (!last || last.time_s < now)) {
      video.pause();
      camera.waiting = true;
    } else if (camera.waiting && (camera.done || (last && last.time_s >= now))) {
      camera.waiting = false;
      video.play().catch(() => {});
    }
    let shown = null;
    for (const record of records) {
      if (record.time_s > now) break;
      shown = record;
    }
    if (shown && camera.info) drawTracked(shown.detections, camera.info.width, camera.info.height);
    requestAnimationFrame(draw);
  };
  draw();
}

function wireCamera() {
  $("camera-start").addEventListener("click", startCamera);
  $("camera-stop").addEventListener("click", stopCamera);
  $("video-file").addEventListener("change", (event) => trackVideoFile(event.target.files[0]));
}

// ---------------------------------------------------------------------------------------------
// Watch the memory

function renderDevices(gpu, listing) {
  const devices = $("devices");
  const note = $("memory-note");
  const accounting = gpu.accounting || {};
  if (!gpu.available || !(gpu.devices || []).length) {
    note.hidden = false;
    note.textContent = "No GPU here" + (gpu.reason ? ` (${gpu.reason})` : "") +
      ": GPU caps are not enforced on this host, and the figures below are the processes' resident host memory.";
    devices.replaceChildren(hostTable(gpu, listing));
    return;
  }
  note.hidden = true;
  const byIndex = new Map((accounting.gpus || []).map((g) => [g.index, g.processes]));
  devices.replaceChildren(...gpu.devices.map((device) => deviceBlock(device, byIndex.get(device.index) || [])),
    el("p", { className: "muted", id: "http-process", text: `This server's HTTP process (pid ${gpu.pid}) holds no GPU ` +
      `memory, as it never loads TensorFlow; it holds ${mib(latest("server"))} of host memory.` }));
}

function deviceBlock(device, processes) {
  const memory = device.memory_mib || {};
  const total = memory.total || 1;
  const meter = el("div", { className: "meter", role: "img",
    "aria-label": `GPU ${device.index}: ${mib(memory.used)} of ${mib(memory.total)} used` });
  for (const p of processes) {
    const key = p.owner === "worker" ? p.model : (p.owner === "server" ? "server" : null);
    const part = el("span", { title: `${processLabel(p)}: ${mib(p.used_mib)}` });
    part.style.width = `${(100 * (p.used_mib || 0)) / total}%`;
    part.style.background = key ? colourOf(key) : OTHER_COLOUR;
    meter.append(part);
  }
  const rows = processes.map((p) => el("tr", { "data-pid": p.pid, "data-owner": p.owner },
    el("td", { text: String(p.pid) }),
    el("td", { text: processLabel(p) }),
    el("td", { className: "num", text: mib(p.used_mib) }),
    el("td", { className: "num", text: p.cap_mib === null ? "–" : mib(p.cap_mib) }),
    el("td", { className: "num" + (p.overhead_mib ? " over" : ""), text: p.overhead_mib === null ? "–" : mib(p.overhead_mib) })));
  if (rows.length === 0) rows.push(el("tr", {}, el("td", { colspan: 5, text: "no process holds memory on this GPU" })));
  return el("div", { className: "device", "data-gpu": device.index },
    el("div", { className: "device-head" },
      el("h3", { text: `GPU ${device.index}${device.name ? ": " + device.name : ""}` }),
      el("span", { className: "muted", text: `${mib(memory.used)} used of ${mib(memory.total)}, ${mib(memory.free)} free` +
        (device.utilization_percent === null || device.utilization_percent === undefined ? "" :
          `, ${device.utilization_percent}% busy`) })),
    meter,
    el("div", { className: "table-wrap" }, el("table", { className: "processes" },
      el("thead", {}, el("tr", {},
        el("th", { scope: "col", text: "PID" }), el("th", { scope: "col", text: "Process" }),
        el("th", { scope: "col", className: "num", text: "Used" }), el("th", { scope: "col", className: "num", text: "Cap" }),
        el("th", { scope: "col", className: "num", text: "Beyond cap" }))),
      el("tbody", {}, ...rows))));
}

function processLabel(p) {
  if (p.owner === "worker") return `worker: ${p.model} v${p.version}`;
  if (p.owner === "server") return "this server's HTTP process";
  if (p.owner === "instance") return `fleet instance ${p.instance}`;
  return "not ours";
}

function hostTable(gpu, listing) {
  const rows = [];
  const byPid = new Map();  // a worker group's one worker serves several models: one row for it
  for (const m of listing.models) {
    if (m.pid === null || m.pid === undefined) continue;
    if (!byPid.has(m.pid)) byPid.set(m.pid, { group: m.worker_group, models: [], memory: m.memory });
    byPid.get(m.pid).models.push(`${m.name} v${m.version}`);
  }
  for (const [pid, w] of byPid) {
    const what = w.group ? `worker of group ${w.group}: ${w.models.join(", ")}` : `worker: ${w.models[0]}`;
    rows.push(el("tr", { "data-pid": pid, "data-owner": "worker", "data-group": w.group || "" },
      el("td", { text: String(pid) }), el("td", { text: what }),
      el("td", { className: "num", text: mib(w.memory && w.memory.used_mib) })));
  }
  for (const s of listing.spares || []) {
    rows.push(el("tr", { "data-pid": s.pid, "data-owner": "spare" },
      el("td", { text: String(s.pid) }), el("td", { text: "spare worker (TensorFlow imported, no model)" }),
      el("td", { className: "num", text: mib(s.rss_mib) })));
  }
  const server = latest("server");
  rows.push(el("tr", { "data-pid": gpu.pid, "data-owner": "server" },
    el("td", { text: String(gpu.pid) }), el("td", { text: "this server's HTTP process" }),
    el("td", { className: "num", text: mib(server) })));
  return el("div", { className: "table-wrap" }, el("table", { className: "processes" },
    el("thead", {}, el("tr", {},
      el("th", { scope: "col", text: "PID" }), el("th", { scope: "col", text: "Process" }),
      el("th", { scope: "col", className: "num", text: "Resident" }))),
    el("tbody", {}, ...rows)));
}

function renderModels(listing) {
  const rows = listing.models.map((m) => {
    const memory = m.memory || {};
    const busy = state.busy.has(m.name);
    const loaded = m.state === "ready" || m.state === "loading";
    const action = el("button", { type: "button", "data-model": m.name, "data-action": loaded ? "unload" : "load",
      disabled: busy || m.state === "loading" || m.state === "unloading",
      text: loaded ? "Unload" : "Load" });
    action.setAttribute("aria-label", `${loaded ? "Unload" : "Load"} ${m.name}`);
    return el("tr", { "data-model": m.name, "data-state": m.state },
      el("th", { scope: "row", text: m.version ? `${m.name} v${m.version}` : m.name }),
      el("td", {}, el("span", { className: `state state-${m.state}`, text: m.state }),
        m.reason ? el("span", { className: "reason", text: m.reason }) : null),
      el("td", { className: "worker", title: m.worker_group ? `shared by ${m.group_members.join(", ")}` : "",
        text: (m.pid === null || m.pid === undefined ? "–" : String(m.pid)) +
          (m.worker_group ? ` (group ${m.worker_group})` : "") }),
      el("td", { className: "num", title: memory.note || "", text: mib(memory.used_mib) }),
      el("td", { className: "num", text: m.gpu_memory || "–" }),
      el("td", {}, action));
  });
  $("models-body").replaceChildren(...rows);
}

async function loadOrUnload(name, action) {
  state.busy.add(name);
  showError($("memory-error"), "");
  try {
    await call("POST", `/v2/repository/models/${encodeURIComponent(name)}/${action}`, "{}", "application/json");
  } catch (err) {
    showError($("memory-error"), `${action} ${name}: ${err.message}`);
  } finally {
    state.busy.delete(name);
    poll();
  }
}

function renderInstance(gpu) {
  const fleet = gpu.accounting && gpu.accounting.fleet;
  $("instance").textContent = gpu.instance ? `instance ${gpu.instance}` : `process ${gpu.pid}`;
  const members = fleet && fleet.members ? fleet.members.filter((m) => !m.this_instance) : [];
  $("fleet").hidden = members.length === 0;
  $("fleet-list").replaceChildren(...members.map((m) => {
    const url = `${location.protocol}//${location.hostname}:${m.port}/`;
    return el("li", {}, el("a", { href: url, text: `${m.name} (${m.model}, ${m.state})` }));
  }));
}

// The chart: the last minutes of memory per model, the HTTP process and the spares, from /gpu/history.

function mergeHistory(answer) {
  state.keepS = answer.keep_s;
  state.offsetS = answer.now_unix - Date.now() / 1000;
  for (const series of answer.series) {
    const key = series.kind === "model" ? series.name : series.kind === "group" ? `group ${series.name}` : series.kind;
    let held = state.history.get(key);
    if (!held) {
      held = { kind: series.kind, name: series.name, samples: [] };
      state.history.set(key, held);
    }
    held.samples.push(...series.samples);
    const oldest = answer.now_unix - answer.keep_s;
    while (held.samples.length && held.samples[0][0] < oldest) held.samples.shift();
    const last = held.samples[held.samples.length - 1];
    if (last && (state.historySince === null || last[0] > state.historySince)) state.historySince = last[0];
  }
}

function latest(key) {
  const held = state.history.get(key);
  if (!held || !held.samples.length) return null;
  return held.samples[held.samples.length - 1][1];
}

function drawChart() {
  const canvas = $("chart");
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  if (!width || !height) return;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const windowS = Number($("window").value);
  const now = Date.now() / 1000 + state.offsetS;
  const start = now - windowS;
  const series = [...state.history.entries()];
  let top = 0;
  for (const [, held] of series) {
    for (const s of held.samples) if (s[0] >= start && s[1] !== null) top = Math.max(top, s[1]);
  }
  top = niceCeiling(Math.max(top, 64));
  const left = 70, right = 10, upper = 10, lower = 24;
  const plotW = width - left - right, plotH = height - upper - lower;
  const x = (t) => left + ((t - start) / windowS) * plotW;
  const y = (v) => upper + plotH - (v / top) * plotH;
  ctx.font = "12px system-ui, sans-serif";
  ctx.fillStyle = "#5a6570";
  ctx.strokeStyle = "#d5dbe1";
  ctx.lineWidth = 1;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (let i = 0; i <= 4; i++) {
    const v = (top * i) / 4;
    ctx.beginPath();
    ctx.moveTo(left, Math.round(y(v)) + 0.5);
    ctx.lineTo(width - right, Math.round(y(v)) + 0.5);
    ctx.stroke();
    ctx.fillText(mib(v), left - 6, y(v));
  }
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  // a label at least every 70 px: 15 s, 30 s, 1, 2 or 5 minutes apart
  const step = [15, 30, 60, 120, 300].find((s) => (s / windowS) * plotW >= 70) || 300;
  for (let ago = 0; ago <= windowS; ago += step) {
    ctx.fillText(ago === 0 ? "now" : `-${ago >= 60 ? ago / 60 + " min" : ago + " s"}`, x(now - ago), upper + plotH + 6);
  }
  ctx.lineWidth = 2;
  ctx.lineJoin = "round";
  for (const [key, held] of series) {
    ctx.strokeStyle = colourOf(key);
    ctx.beginPath();
    let drawing = false;
    let previous = null;
    for (const s of held.samples) {
      if (s[0] < start - 2 || s[1] === null) { drawing = false; continue; }
      if (!drawing) ctx.moveTo(x(s[0]), y(s[1]));
      else ctx.lineTo(x(s[0]), y(previous));  // memory is a step: it holds until the next sample
      ctx.lineTo(x(s[0]), y(s[1]));
      previous = s[1];
      drawing = true;
    }
    ctx.stroke();
  }
  $("legend").replaceChildren(...series.map(([key, held]) => {
    const swatch = el("span", { className: "swatch" });
    swatch.style.background = colourOf(key);
    const last = held.samples[held.samples.length - 1];
    const label = held.kind === "model" || held.kind === "group" ? key : key === "server" ? "HTTP process" : "spare workers";
    const source = last ? (last[2] === "nvml" ? "GPU" : "resident") : "";
    return el("li", { "data-series": key }, swatch, `${label}: ${mib(last ? last[1] : null)} ${source}` +
      ((held.kind === "model" || held.kind === "group") && last ? ` (${last[3]})` : ""));
  }));
}

function niceCeiling(value) {
  const power = 10 ** Math.floor(Math.log10(value));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * power >= value) return m * power;
  return 10 * power;
}

// ---------------------------------------------------------------------------------------------
// The loop

let polling = false;

async function poll() {
  if (polling) return;
  polling = true;
  try {
    const since = state.historySince === null ? "" : `?since=${state.historySince}`;
    const [listing, gpu, history] = await Promise.all([
      call("GET", "/models"), call("GET", "/gpu"), call("GET", `/gpu/history${since}`)]);
    state.models = listing.models;
    mergeHistory(history);
    fillModels(listing);
    renderModels(listing);
    renderDevices(gpu, listing);
    renderInstance(gpu);
    drawChart();
    showError($("memory-error"), "");
    document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
  } catch (err) {
    showError($("memory-error"), `The memory panel could not update: ${err.message || err}`);
  } finally {
    polling = false;
  }
}

function start() {
  wireTryPanel();
  wireCamera();
  $("models-body").addEventListener("click", (event) => {
    const button = event.target.closest("button[data-action]");
    if (button) loadOrUnload(button.dataset.model, button.dataset.action);
  });
  $("window").addEventListener("change", drawChart);
  window.addEventListener("resize", drawChart);
  poll();
  setInterval(() => { if (!document.hidden) poll(); }, POLL_MS);
}

start();
