#!/usr/bin/env node
// Independent reference encoder for the Kimi K3 tokenizer, used to check the
// C++ tokenizer (engine/tokenizer). No npm dependencies.
//
// It shares nothing with the C++ code but the vendored files: it reads
// tiktoken.model and pat_str.json from --model DIR, turns pat_str into a
// JavaScript RegExp with the `v` flag (which supports class intersection), runs
// the upstream 400,000 / 25,000 character chunking and the plain tiktoken
// merge loop (repeatedly merge the lowest-ranked adjacent pair).
//
// Protocol (same as //engine/tokenizer:tokenize): JSON lines {"text": "..."} on
// stdin, one {"ids": [...]} per line on stdout; a bad line gives
// {"error": "..."} and the exit status is 1 at the end.
//
//   node tools/node/tiktoken_oracle.mjs --model third_party/kimi_k3_tokenizer < in.jsonl
//   node tools/node/tiktoken_oracle.mjs --model DIR --bench FILE [--repeat N]
//     encodes every {"text"} line of FILE once untimed, then N times timed, and
//     prints one JSON line {"bytes": ..., "seconds": ..., "tokens": ...}.
//   node tools/node/tiktoken_oracle.mjs --model DIR --split
//     prints {"pieces": [...]} (the pre-tokeniser output) instead of ids.

import fs from 'node:fs';
import path from 'node:path';
import readline from 'node:readline';

const MAX_ENCODE_CHARS = 400000;
const MAX_RUN_CHARS = 25000;

function parseArgs(argv) {
  const args = {model: null, bench: null, repeat: 1, split: false};
  for (let i = 2; i < argv.length; i++) {
    const a = argv[i];
    if (a === '--model') args.model = argv[++i];
    else if (a === '--bench') args.bench = argv[++i];
    else if (a === '--repeat') args.repeat = Number(argv[++i]);
    else if (a === '--split') args.split = true;
    else throw new Error(`unknown argument ${a}`);
  }
  if (!args.model) throw new Error('--model DIR is required');
  return args;
}

// tiktoken.model: "base64(token) rank" per line. Keys are the token bytes as a
// latin1 string (one char per byte).
function loadRanks(file) {
  const ranks = new Map();
  const text = fs.readFileSync(file, 'latin1');
  for (const line of text.split('\n')) {
    if (line === '') continue;
    const sp = line.indexOf(' ');
    if (sp < 0) throw new Error(`bad line in ${file}: ${line}`);
    const token = Buffer.from(line.slice(0, sp), 'base64').toString('latin1');
    ranks.set(token, Number(line.slice(sp + 1)));
  }
  return ranks;
}

// The pat_str of tokenization_kimi.py uses Rust-regex syntax. JavaScript (`v`
// flag) differs in four places, each rewritten here and checked to occur:
//  - \p{Han} is a script: \p{Script=Han};
//  - \s / \S in Rust are White_Space; JavaScript's \s adds U+FEFF and lacks
//    U+0085, so use the property;
//  - an intersection operand that is a union must be bracketed in `v` mode;
//  - Node 20 has no (?i:...) group: spell out the simple case folds (s also
//    folds with U+017F LONG S).
function buildRegex(patStr) {
  let p = patStr;
  const replaceAll = (from, to) => {
    if (!p.includes(from)) throw new Error(`pat_str lacks ${from}`);
    p = p.split(from).join(to);
  };
  replaceAll('[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]',
             '[[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]&&[^\\p{Han}]]');
  replaceAll('[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]',
             '[[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]&&[^\\p{Han}]]');
  replaceAll('\\p{Han}', '\\p{Script=Han}');
  replaceAll('\\s', '\\p{White_Space}');
  replaceAll('\\S', '\\P{White_Space}');
  replaceAll("(?i:'s|'t|'re|'ve|'m|'ll|'d)",
             "(?:'[sS\\u017F]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])");
  return new RegExp(p, 'gv');
}

// Python's str.isspace(): White_Space plus U+001C..U+001F.
function pyIsSpace(cp) {
  return (cp >= 0x09 && cp <= 0x0d) || (cp >= 0x1c && cp <= 0x20) || cp === 0x85 ||
         cp === 0xa0 || cp === 0x1680 || (cp >= 0x2000 && cp <= 0x200a) ||
         cp === 0x2028 || cp === 0x2029 || cp === 0x202f || cp === 0x205f ||
         cp === 0x3000;
}

// The upstream chunking: code-point slices of MAX_ENCODE_CHARS, each split where
// a run of whitespace or non-whitespace would exceed MAX_RUN_CHARS.
function* chunks(text) {
  const cps = Array.from(text);
  for (let i = 0; i < cps.length; i += MAX_ENCODE_CHARS) {
    const s = cps.slice(i, i + MAX_ENCODE_CHARS);
    let runLen = 0;
    let runIsSpace = s.length > 0 ? pyIsSpace(s[0].codePointAt(0)) : false;
    let start = 0;
    for (let j = 0; j < s.length; j++) {
      const isSpace = pyIsSpace(s[j].codePointAt(0));
      if (runIsSpace !== isSpace) {
        runLen = 1;
        runIsSpace = isSpace;
      } else {
        runLen += 1;
        if (runLen > MAX_RUN_CHARS) {
          yield s.slice(start, j).join('');
          start = j;
          runLen = 1;
        }
      }
    }
    yield s.slice(start).join('');
  }
}

// The plain tiktoken merge: parts are byte offsets; repeatedly merge the
// adjacent pair whose concatenation has the lowest rank (leftmost on ties).
function bytePairEncode(bytes, ranks, out) {
  const whole = ranks.get(bytes);
  if (whole !== undefined) {
    out.push(whole);
    return;
  }
  const n = bytes.length;
  const pos = [];
  for (let i = 0; i <= n; i++) pos.push(i);
  const rankOf = (a, b) => {
    const r = ranks.get(bytes.slice(a, b));
    return r === undefined ? Infinity : r;
  };
  const pair = [];
  for (let i = 0; i + 2 < pos.length; i++) pair.push(rankOf(pos[i], pos[i + 2]));
  while (pair.length > 0) {
    let best = Infinity;
    let bi = -1;
    for (let i = 0; i < pair.length; i++) {
      if (pair[i] < best) {
        best = pair[i];
        bi = i;
      }
    }
    if (bi < 0) break;
    pos.splice(bi + 1, 1);
    pair.splice(bi, 1);
    if (bi < pair.length) pair[bi] = rankOf(pos[bi], pos[bi + 2]);
    if (bi > 0) pair[bi - 1] = rankOf(pos[bi - 1], pos[bi + 1]);
  }
  for (let i = 0; i + 1 < pos.length; i++) {
    const r = ranks.get(bytes.slice(pos[i], pos[i + 1]));
    if (r === undefined) throw new Error('byte without a rank');
    out.push(r);
  }
}

function pieces(text, regex) {
  const result = [];
  for (const chunk of chunks(text)) {
    for (const m of chunk.matchAll(regex)) result.push(m[0]);
  }
  return result;
}

function encode(text, regex, ranks) {
  const ids = [];
  for (const piece of pieces(text, regex)) {
    bytePairEncode(Buffer.from(piece, 'utf8').toString('latin1'), ranks, ids);
  }
  return ids;
}

async function main() {
  const args = parseArgs(process.argv);
  const ranks = loadRanks(path.join(args.model, 'tiktoken.model'));
  const patStr = JSON.parse(fs.readFileSync(path.join(args.model, 'pat_str.json'), 'utf8')).pat_str;
  const regex = buildRegex(patStr);

  if (args.bench) {
    const texts = [];
    for (const line of fs.readFileSync(args.bench, 'utf8').split('\n')) {
      if (line.trim() !== '') texts.push(JSON.parse(line).text);
    }
    for (const t of texts) encode(t, regex, ranks);  // warm-up (JIT), not timed
    let bytes = 0;
    let tokens = 0;
    const t0 = process.hrtime.bigint();
    for (let r = 0; r < args.repeat; r++) {
      for (const t of texts) {
        bytes += Buffer.byteLength(t, 'utf8');
        tokens += encode(t, regex, ranks).length;
      }
    }
    const seconds = Number(process.hrtime.bigint() - t0) / 1e9;
    process.stdout.write(JSON.stringify({bytes, seconds, tokens}) + '\n');
    return;
  }

  let failed = false;
  const rl = readline.createInterface({input: process.stdin, crlfDelay: Infinity});
  const out = [];
  for await (const line of rl) {
    let text;
    try {
      const obj = JSON.parse(line);
      if (typeof obj !== 'object' || obj === null || typeof obj.text !== 'string') {
        throw new Error('expected an object with a string "text"');
      }
      text = obj.text;
    } catch (e) {
      failed = true;
      out.push(JSON.stringify({error: String(e.message)}));
      continue;
    }
    if (args.split) out.push(JSON.stringify({pieces: pieces(text, regex)}));
    else out.push(JSON.stringify({ids: encode(text, regex, ranks)}));
    if (out.length >= 256) {
      process.stdout.write(out.join('\n') + '\n');
      out.length = 0;
    }
  }
  if (out.length > 0) process.stdout.write(out.join('\n') + '\n');
  process.exitCode = failed ? 1 : 0;
}

main().catch((e) => {
  process.stderr.write(`tiktoken_oracle: ${e.stack || e}\n`);
  process.exit(2);
});
