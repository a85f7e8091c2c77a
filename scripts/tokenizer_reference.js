// tokenizer_reference.js - the reference side of test/test_data.h's tokenizer tests: encodes documents
// with the JavaScript GPT-2 encoder of gpt-3-encoder@1.1.4 (its own regex, byte map and BPE, run
// unchanged), or prints this node's regex classes of every code point.
//
//   node scripts/tokenizer_reference.js encode ENCODER_JS DOCS IDS
//       DOCS: documents as (uint32 length, bytes)...; IDS: per document (uint32 count, uint32 ids...)
//   node scripts/tokenizer_reference.js classes OUT
//       OUT: one byte per code point 0..0x10FFFF: 0 other, 1 \p{L}, 2 \p{N}, 3 \s (as lib/unicode_classes.h)
//
// Documents are bytes and need not be valid UTF-8, but the encoder takes a JS string. Each byte that
// starts no valid UTF-8 sequence is carried as the lone surrogate U+DC00+byte (Python's
// surrogateescape; lone surrogates are "other" to the regex, as invalid bytes are to lib/tokenizer.h),
// and the TextEncoder the encoder uses to get a piece's bytes is replaced by one that turns those
// surrogates back into their bytes. Valid text never contains a lone surrogate, so nothing else
// changes.
'use strict';
const fs = require('fs');

class BytePreservingEncoder {
    encode(str) {
        const out = [];
        for (const ch of str) {
            const cp = ch.codePointAt(0);
            if (cp >= 0xDC80 && cp <= 0xDCFF) out.push(cp - 0xDC00);
            else out.push(...Buffer.from(ch, 'utf-8'));
        }
        return Uint8Array.from(out);
    }
}

// The byte-to-string step, with lib/tokenizer.h's validity rules (shortest form, no surrogates, <= U+10FFFF).
function decodeBytes(b) {
    let s = '';
    for (let i = 0; i < b.length;) {
        const c = b[i];
        let len = 0, lo = 0x80, hi = 0xBF, cp = 0;
        if (c < 0x80) { s += String.fromCharCode(c); i++; continue; }
        if (c >= 0xC2 && c <= 0xDF) { len = 2; cp = c & 0x1F; }
        else if (c >= 0xE0 && c <= 0xEF) { len = 3; cp = c & 0x0F; if (c === 0xE0) lo = 0xA0; if (c === 0xED) hi = 0x9F; }
        else if (c >= 0xF0 && c <= 0xF4) { len = 4; cp = c & 0x07; if (c === 0xF0) lo = 0x90; if (c === 0xF4) hi = 0x8F; }
        let ok = len > 0 && i + len <= b.length && b[i + 1] >= lo && b[i + 1] <= hi;
        for (let k = 1; ok && k < len; k++) {
            if ((b[i + k] & 0xC0) !== 0x80) ok = false;
            else cp = cp * 64 + (b[i + k] & 0x3F);
        }
        if (ok) { s += String.fromCodePoint(cp); i += len; }
        else { s += String.fromCharCode(0xDC00 + c); i++; }
    }
    return s;
}

function encodeDocs(encoderJs, docsPath, idsPath) {
    globalThis.TextEncoder = BytePreservingEncoder;  // read once, when the encoder module loads
    const { encode } = require(require('path').resolve(encoderJs));
    const data = fs.readFileSync(docsPath);
    const chunks = [];
    for (let p = 0; p < data.length;) {
        const n = data.readUInt32LE(p);
        const ids = encode(decodeBytes(data.subarray(p + 4, p + 4 + n)));
        const out = Buffer.alloc(4 + 4 * ids.length);
        out.writeUInt32LE(ids.length, 0);
        ids.forEach((id, k) => out.writeUInt32LE(id === undefined ? 0xFFFFFFFF : id, 4 + 4 * k));
        chunks.push(out);
        p += 4 + n;
    }
    fs.writeFileSync(idsPath, Buffer.concat(chunks));
}

function classes(outPath) {
    const L = /\p{L}/u, N = /\p{N}/u, S = /\s/u;
    const out = Buffer.alloc(0x110000);
    for (let cp = 0; cp < 0x110000; cp++) {
        if (cp >= 0xD800 && cp <= 0xDFFF) continue;
        const s = String.fromCodePoint(cp);
        out[cp] = L.test(s) ? 1 : N.test(s) ? 2 : S.test(s) ? 3 : 0;
    }
    fs.writeFileSync(outPath, out);
    process.stdout.write(process.versions.unicode + '\n');
}

const [mode, ...args] = process.argv.slice(2);
if (mode === 'encode' && args.length === 3) encodeDocs(...args);
else if (mode === 'classes' && args.length === 1) classes(...args);
else {
    process.stderr.write('usage: node scripts/tokenizer_reference.js encode ENCODER_JS DOCS IDS | classes OUT\n');
    process.exit(2);
}
