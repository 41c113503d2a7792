// Attention maps as captioner.pictures.overlay draws them in the PNG pictures, for the page.
//
// A map (rows x cols weights summing to 1) is upsampled with each weight at its cell's
// receptive-field centre (origin + j * stride, as a fraction of the image side), bicubically between
// the centres (torch grid_sample's kernel, A = -0.75, edge cells repeated), then coloured on one
// fixed scale for every word: log of the weight as a multiple of the even share 1/L, from 0 (even or
// less: clear) to 1 (all on one cell), with opacity following it.

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

export function jet(v) { return JET.map((points) => Math.round(255 * channel(points, v))); }

export function heat(weight, regions) {
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
export function upsample(map, width, height, cells) {
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
