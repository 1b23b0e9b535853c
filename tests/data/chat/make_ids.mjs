#!/usr/bin/env node
// Fills "expected_ids" in each golden whose ids are not from a public oracle.
// Independent of the C++ renderer: it derives the segments from the golden's
// hand-written expected text (or takes its explicit "expected_segments") and
// encodes each segment with the Node oracle (tools/node/tiktoken_oracle.mjs):
// structure spellings in markup become their ids, everything else plain BPE.
//
//   node tests/data/chat/make_ids.mjs   (from the repository root)
//
// Segment derivation (the reference's _open_tag/_close_tag/_attr): after
// <|open|> the header up to <|sep|> is `name` then ` key`, `="`, value, `"`
// per attribute; after <|close|> the name; anything else is text. Strings in
// "literal_texts" are text even when they contain marker spellings.
import fs from 'node:fs';
import path from 'node:path';
import {execFileSync} from 'node:child_process';

const DIR = 'tests/data/chat';
const IDS = {'<|open|>': 163587, '<|close|>': 163588, '<|sep|>': 163589, '<|end_of_msg|>': 163586};
const MARKER = /(<\|open\|>|<\|close\|>|<\|sep\|>|<\|end_of_msg\|>)/;

function derive(text, literals) {
  const placeholders = [];
  for (const lit of literals || []) {
    const key = `\u0000${placeholders.length}\u0000`;
    placeholders.push(lit);
    text = text.split(lit).join(key);
  }
  const restore = (s) => s.replace(/\u0000(\d+)\u0000/g, (_, i) => placeholders[Number(i)]);
  const pieces = text.split(MARKER).filter((p) => p !== '');
  const segs = [];
  let state = 'text';
  for (const p of pieces) {
    if (p in IDS) {
      segs.push(['M', p]);
      if (p === '<|open|>') state = 'open';
      else if (p === '<|close|>') state = 'close';
      else state = 'text';
      continue;
    }
    if (state === 'close') {
      segs.push(['M', p]);
    } else if (state === 'open') {
      const m = /^([^ ]+)((?: [^=]+="[^"]*")*)$/.exec(p);
      if (!m) throw new Error(`bad header: ${p}`);
      segs.push(['M', m[1]]);
      for (const a of m[2].matchAll(/ ([^=]+)="([^"]*)"/g)) {
        segs.push(['M', ' ' + a[1]], ['M', '="'], ['T', a[2]], ['M', '"']);
      }
    } else {
      segs.push(['T', restore(p)]);
    }
    state = 'text';
  }
  return segs;
}

for (const file of fs.readdirSync(DIR).filter((f) => f.endsWith('.json')).sort()) {
  const full = path.join(DIR, file);
  const golden = JSON.parse(fs.readFileSync(full, 'utf8'));
  if (golden.ids_source === 'public-oracle') continue;
  const text = golden.expected_text_parts.join('');
  const segs = golden.expected_segments || derive(text, golden.literal_texts);
  if (segs.map((s) => s[1]).join('') !== text) throw new Error(`${file}: segments do not join to the text`);
  const plain = segs.filter((s) => !(s[0] === 'M' && s[1] in IDS));
  const out = execFileSync('node', ['tools/node/tiktoken_oracle.mjs', '--model', 'third_party/kimi_k3_tokenizer'],
                           {input: plain.map((s) => JSON.stringify({text: s[1]})).join('\n') + '\n'});
  const encoded = out.toString().trim().split('\n').map((l) => JSON.parse(l).ids);
  const ids = [];
  let k = 0;
  for (const s of segs) {
    if (s[0] === 'M' && s[1] in IDS) ids.push(IDS[s[1]]);
    else ids.push(...encoded[k++]);
  }
  golden.ids_source = 'node-oracle';
  golden.expected_ids = ids;
  const json = JSON.stringify(golden, null, 2).replace(/\[\s+(\d[\d,\s]*?)\s+\]/g,
      (_, body) => '[' + body.split(/,\s*/).join(', ') + ']');
  fs.writeFileSync(full, json + '\n');
  console.log(`${file}: ${segs.length} segments, ${ids.length} ids`);
}
