// Run NanoDet-g's TensorFlow.js graph model on TensorFlow.js's WebAssembly backend: the reference the
// objects export (tools/export/objects.py) is checked against, in tests/test_objects.py.
//
//   node nanodet_heads.mjs MODEL_DIR INPUT.f32 COUNT OUT_DIR
//
// MODEL_DIR holds nanodet.json and nanodet.bin as the npm package ships them; they are loaded through an
// in-memory IO handler (no fetch, no file:// loader). INPUT.f32 holds COUNT pre-processed images, float32
// little-endian [COUNT, 3, 416, 416]; each runs alone (the graph is fixed at batch 1). For every output
// the script writes OUT_DIR/<output>.f32 (the COUNT answers one after the other) and OUT_DIR/outputs.json
// with each output's shape for one image and the backend that ran.
import { readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';

import * as tf from '@tensorflow/tfjs-core';
import { loadGraphModel } from '@tensorflow/tfjs-converter';
import '@tensorflow/tfjs-backend-wasm';

const [modelDir, inputPath, countText, outDir] = process.argv.slice(2);
const count = Number(countText);

const model = JSON.parse(readFileSync(join(modelDir, 'nanodet.json'), 'utf8'));
const bin = readFileSync(join(modelDir, 'nanodet.bin'));
const handler = {
  load: async () => ({
    modelTopology: model.modelTopology,
    weightSpecs: model.weightsManifest.flatMap((group) => group.weights),
    weightData: bin.buffer.slice(bin.byteOffset, bin.byteOffset + bin.byteLength),
    format: model.format,
    generatedBy: model.generatedBy,
    convertedBy: model.convertedBy,
    signature: model.signature,
  }),
};

await tf.setBackend('wasm');
await tf.ready();
const graph = await loadGraphModel(handler);

const names = Object.keys(model.signature.outputs).map((name) => name.split(':')[0]).sort();
const raw = readFileSync(inputPath);
const input = new Float32Array(raw.buffer.slice(raw.byteOffset, raw.byteOffset + raw.byteLength));
const size = 3 * 416 * 416;
if (input.length !== count * size) {
  throw new Error(`${inputPath} holds ${input.length} floats, not ${count} x 3 x 416 x 416`);
}
const answers = Object.fromEntries(names.map((name) => [name, []]));
const shapes = {};
for (let i = 0; i < count; i += 1) {
  const image = tf.tensor4d(input.subarray(i * size, (i + 1) * size), [1, 3, 416, 416]);
  const outputs = graph.execute({ input_1: image }, names);
  for (const [j, name] of names.entries()) {
    shapes[name] = outputs[j].shape;
    answers[name].push(outputs[j].dataSync().slice());
    outputs[j].dispose();
  }
  image.dispose();
}
for (const name of names) {
  const joined = new Float32Array(answers[name].reduce((n, a) => n + a.length, 0));
  let offset = 0;
  for (const part of answers[name]) {
    joined.set(part, offset);
    offset += part.length;
  }
  writeFileSync(join(outDir, `${name}.f32`), Buffer.from(joined.buffer));
}
writeFileSync(join(outDir, 'outputs.json'), JSON.stringify({ backend: tf.getBackend(), tfjs: tf.version_core, shapes }));
