#!/usr/bin/env node
// diff_random.js: differential check against the real Hugging Face tokenizers on random strings
// (not run by `make test`). Writes DIR/tokenizers/goldens.json in the goldens.json format for the
// vocabularies named on the command line, so the test binary can be pointed at it:
//   NODE_PATH=/tmp/tokwork/node_modules node tests/gen/tokenizer/diff_random.js DIR N SEED qwen3 ...
//   (DIR/tokenizers/<name> and DIR/tiny linked to the repo's tests/data ones)
//   PETREL_TEST_DATA=DIR build/petrel-tests tokenizer.golden_qwen3
const fs = require('fs');
const path = require('path');
const { Tokenizer } = require('@anush008/tokenizers');
const [dir, nStr, seedStr, ...names] = process.argv.slice(2);
let seed = Number(seedStr) || 1;
const rnd = (n) => { seed = (seed * 1103515245 + 12345) % 2147483648; return seed % n; };
const pool = [..." \t\n\r\u00a0\u3000\u2028\u0085\u200b\u200d\ufeff'\"sStTlLdDmMrReEvV0123456789٣४" +
  "aeiouxyzAEIOUXYZ.,;:!?-_()[]{}<>|/\\@#$%^&*+=~`ſKﬁÅé\u0301\u0308ñçßøœ中文日本語カタカナ한국어" +
  "абвгдΩλअआक्षதமிழ்ខ្មែរไทย🙂👍🏽👨‍👩‍👧🇫🇷"];
const specials = ['<|im_start|>', '<|im_end|>', '<|endoftext|>', '<｜end▁of▁sentence｜>', '[gMASK]', '<|user|>', '<think>', '</think>'];
const cases = [];
for (let i = 0; i < Number(nStr); i++) {
  let s = '';
  const k = 1 + rnd(40);
  for (let j = 0; j < k; j++) s += rnd(25) ? pool[rnd(pool.length)] : specials[rnd(specials.length)];
  if (!/[\ud800-\udfff]/.test(s.replace(/[\ud800-\udbff][\udc00-\udfff]/g, ''))) cases.push(s);
}
(async () => {
  const out = {};
  for (const name of names) {
    const f = name === 'tiny' ? 'tiny/tokenizer.json' : path.join('tokenizers', name, 'tokenizer.json');
    const tok = Tokenizer.fromFile(path.join(dir, f));
    const cs = [];
    for (const text of cases) cs.push({ text, ids: (await tok.encode(text, null, { addSpecialTokens: false })).getIds() });
    out[name] = { file: f, roundtrip: false, cases: cs };
  }
  fs.writeFileSync(path.join(dir, 'tokenizers', 'goldens.json'), JSON.stringify(out));
})();
