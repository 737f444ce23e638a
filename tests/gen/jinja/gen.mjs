// gen.mjs: regenerates the golden chat-template renderings under tests/data/jinja with
// Hugging Face's own Jinja (@huggingface/jinja), the reference petrel's interpreter follows.
//
//   mkdir -p /tmp/jwork && cd /tmp/jwork && npm install @huggingface/jinja
//   NODE_PATH=/tmp/jwork/node_modules node tests/gen/jinja/gen.mjs      (from the repo root)
//
// Inputs:  tests/data/templates/GLM-5.2.jinja, GLM-4.6.jinja, tests/data/jinja/templates/*.jinja
//          tests/data/jinja/conversations/*.json   (request objects: every key is a variable)
//          tests/data/jinja/lang/cases.json         ([{name, template, vars}] language cases)
// Outputs: tests/data/jinja/golden/TEMPLATE__CONV.txt (the exact rendering) or .err (it fails)
//          tests/data/jinja/golden/manifest.txt      ("TEMPLATE_PATH CONV_PATH GOLDEN_PATH" lines)
//          tests/data/jinja/lang/expected.json       ([{name, output} or {name, error}])
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";

const require = createRequire(path.join(process.env.NODE_PATH || process.cwd(), "x.js"));
let jinja;
try {
  jinja = require("@huggingface/jinja");
} catch {
  jinja = require(path.join(process.env.NODE_PATH || "", "@huggingface/jinja"));
}
const { Template } = jinja;

const D = "tests/data";
const templates = [
  `${D}/templates/GLM-5.2.jinja`,
  `${D}/templates/GLM-4.6.jinja`,
  ...fs.readdirSync(`${D}/jinja/templates`).sort().map((f) => `${D}/jinja/templates/${f}`),
];
const convs = fs.readdirSync(`${D}/jinja/conversations`).filter((f) => f.endsWith(".json")).sort();
const outDir = `${D}/jinja/golden`;
fs.rmSync(outDir, { recursive: true, force: true });
fs.mkdirSync(outDir, { recursive: true });
const manifest = [];
let nerr = 0;
for (const tp of templates) {
  const tname = path.basename(tp, ".jinja");
  const tmpl = new Template(fs.readFileSync(tp, "utf8"));
  for (const c of convs) {
    const cp = `${D}/jinja/conversations/${c}`;
    const req = JSON.parse(fs.readFileSync(cp, "utf8"));
    const base = `${outDir}/${tname}__${path.basename(c, ".json")}`;
    let golden;
    try {
      fs.writeFileSync(`${base}.txt`, tmpl.render(req));
      golden = `${base}.txt`;
    } catch (e) {
      fs.writeFileSync(`${base}.err`, String(e.message) + "\n");
      golden = `${base}.err`;
      nerr++;
    }
    manifest.push(`${tp} ${cp} ${golden}`);
  }
}
fs.writeFileSync(`${outDir}/manifest.txt`, manifest.join("\n") + "\n");

const cases = JSON.parse(fs.readFileSync(`${D}/jinja/lang/cases.json`, "utf8"));
const expected = cases.map(({ name, template, vars }) => {
  try {
    return { name, output: new Template(template).render(vars || {}) };
  } catch (e) {
    return { name, error: String(e.message) };
  }
});
fs.writeFileSync(`${D}/jinja/lang/expected.json`, JSON.stringify(expected, null, 1) + "\n");
console.log(`${manifest.length} renderings (${nerr} errors), ${cases.length} language cases`);
