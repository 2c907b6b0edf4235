// A compact SentencePiece-BPE tokenizer for vocabularies without merges (Gemma's):
// specdec.model._spm_native.
//
// It gives exactly the ids and texts of the `tokenizers.Tokenizer` that
// specdec/model/tokenizer.py builds for such a vocabulary (``_sentencepiece_bpe`` for Gemma):
//
// * added tokens (all literal, none normalized) are found in the raw text leftmost-longest (the
//   library's Aho-Corasick); with ``plain`` the ones flagged so are skipped but still consumed,
//   as ``encode_special_tokens`` does;
// * the text between them has every " " replaced by "\u2581" and is one BPE word: one symbol per
//   character (its vocabulary id, else its bytes' "<0xXX>" tokens, else the unknown token, fused),
//   then merges applied lowest rank first, leftmost on ties, through the same priority queue and
//   stale-entry rule as the library's ``Word::merge_all``;
// * the merges are never listed: the pair (a, b) merges when the string a + b is a token t, with
//   rank (position of t, longer left part first), which is the order ``_gemma_merges`` lists
//   them in (every cut of t into two tokens, token by token, longest left part first);
// * decoding is the decoder chain Replace("\u2581", " "), ByteFallback, Fuse.
//
// Memory: the vocabulary's bytes in one buffer, an offset per token, and an open-addressing
// table of token ids (Gemma 3's 262,144 tokens: ~6 MB, against ~70 MB for the library's maps and
// its 515k merges). Encoding releases the GIL.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <queue>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

constexpr uint64_t kFnvOffset = 1469598103934665603ull;
constexpr uint64_t kFnvPrime = 1099511628211ull;
constexpr char kSpace[] = "\xe2\x96\x81";  // U+2581, SentencePiece's visible space

inline uint64_t fnv(uint64_t h, const char* p, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    h ^= static_cast<unsigned char>(p[i]);
    h *= kFnvPrime;
  }
  return h;
}

inline uint64_t mix(uint64_t h) {  // the table index from the high-quality bits
  h ^= h >> 29;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 32;
  return h;
}

// Length of the UTF-8 character starting with byte ``b`` (1 for a stray continuation byte).
inline size_t char_len(unsigned char b) {
  if (b < 0x80) return 1;
  if (b >= 0xF0) return 4;
  if (b >= 0xE0) return 3;
  if (b >= 0xC0) return 2;
  return 1;
}

// Strict UTF-8 check (Rust's String::from_utf8: no overlongs, surrogates or > U+10FFFF).
bool valid_utf8(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0, n = s.size();
  while (i < n) {
    unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
      cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + len > n) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)) ||
        (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    i += len;
  }
  return true;
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

struct Symbol {
  int32_t id;
  int32_t prev;
  int32_t next;
  int32_t len;  // bytes; 0 once merged into its left neighbour
};

struct Merge {
  uint64_t rank;
  int32_t pos;
  int32_t new_id;
  int32_t left;  // the pair's ids when queued: still those, the entry is current
  int32_t right;
};

// Pairs already looked up during one encode (a text repeats its pairs: runs of spaces, common
// words); direct-mapped, a miss just asks the vocabulary.
class PairCache {
 public:
  explicit PairCache(size_t text_bytes) {
    size_t cap = 256;
    while (cap < text_bytes && cap < (size_t{1} << 14)) cap <<= 1;
    keys_.assign(cap, ~uint64_t{0});
    values_.resize(cap);
    mask_ = cap - 1;
  }
  template <class F>
  int32_t get(int32_t a, int32_t b, F&& lookup) {
    const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) |
                         static_cast<uint32_t>(b);
    const size_t slot = (key * 0x9E3779B97F4A7C15ull) >> 40 & mask_;
    if (keys_[slot] != key) {
      keys_[slot] = key;
      values_[slot] = lookup(a, b);
    }
    return values_[slot];
  }

 private:
  std::vector<uint64_t> keys_;
  std::vector<int32_t> values_;
  size_t mask_;
};

struct MergeAfter {  // std::priority_queue pops the greatest: lowest rank, then lowest position
  bool operator()(const Merge& a, const Merge& b) const {
    if (a.rank != b.rank) return a.rank > b.rank;
    return a.pos > b.pos;
  }
};

class SpmBpe {
 public:
  // ``tokens``: the vocabulary (unique strings, ids in order); ``unk_id``: the unknown token
  // (-1: none); ``added``: the added tokens' ids (tokens of the vocabulary) with, per token,
  // whether decoding drops it with skip_special_tokens (``special``) and whether plain encoding
  // reads it as text (``plain_text``).
  SpmBpe(const py::list& tokens, int32_t unk_id) : unk_id_(unk_id) {
    const size_t n = tokens.size();
    offsets_.reserve(n + 1);
    offsets_.push_back(0);
    for (const py::handle& item : tokens) {
      Py_ssize_t len = 0;
      const char* p = PyUnicode_AsUTF8AndSize(item.ptr(), &len);
      if (p == nullptr) throw py::error_already_set();
      bytes_.append(p, static_cast<size_t>(len));
      offsets_.push_back(static_cast<uint32_t>(bytes_.size()));
    }
    bytes_.shrink_to_fit();
    size_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    mask_ = cap - 1;
    table_.assign(cap, 0);
    for (size_t id = 0; id < n; ++id) {
      std::string_view s = token(static_cast<int32_t>(id));
      size_t slot = mix(fnv(kFnvOffset, s.data(), s.size())) & mask_;
      while (table_[slot] != 0) {
        if (token(static_cast<int32_t>(table_[slot] - 1)) == s)
          throw std::invalid_argument("duplicate token in the vocabulary");
        slot = (slot + 1) & mask_;
      }
      table_[slot] = static_cast<uint32_t>(id + 1);
    }
    for (int c = 0; c < 0x80; ++c) {  // one-byte characters, as normalized (" " -> "\u2581")
      const char ch = static_cast<char>(c);
      ascii_ids_[c] = c == ' ' ? lookup(kSpace, 3) : lookup(&ch, 1);
    }
    for (int b = 0; b < 256; ++b) {
      char name[7];
      std::snprintf(name, sizeof name, "<0x%02X>", b);
      byte_ids_[b] = lookup(name, 6);
    }
    // ByteFallback's test, on each token after "\u2581" -> " ": 6 bytes "<0x" HH ">" where HH is
    // what Rust's u8::from_str_radix(HH, 16) accepts (two hex digits, or "+" and one).
    for (size_t id = 0; id < n; ++id) {
      std::string s = decoded_piece(static_cast<int32_t>(id));
      if (s.size() != 6 || s.compare(0, 3, "<0x") != 0 || s[5] != '>') continue;
      int hi = hex_digit(s[3]), lo = hex_digit(s[4]);
      int value = -1;
      if (hi >= 0 && lo >= 0)
        value = hi * 16 + lo;
      else if (s[3] == '+' && lo >= 0)
        value = lo;
      if (value >= 0) byte_of_[static_cast<int32_t>(id)] = static_cast<uint8_t>(value);
    }
    flags_.assign(n, 0);
  }

  void set_added(const std::vector<int32_t>& ids, const std::vector<bool>& special,
                 const std::vector<bool>& plain_text) {
    if (ids.size() != special.size() || ids.size() != plain_text.size())
      throw std::invalid_argument("set_added: lengths differ");
    std::fill(flags_.begin(), flags_.end(), 0);
    trie_.assign(1, Node{});
    edges_.clear();
    std::fill(std::begin(first_), std::end(first_), false);
    for (size_t k = 0; k < ids.size(); ++k) {
      int32_t id = ids[k];
      if (id < 0 || static_cast<size_t>(id) >= size())
        throw std::invalid_argument("added token id out of range");
      flags_[id] = kAdded | (special[k] ? kSpecial : 0) | (plain_text[k] ? kPlainText : 0);
      std::string_view s = token(id);
      if (s.empty()) continue;
      first_[static_cast<unsigned char>(s[0])] = true;
      int32_t node = 0;
      for (char c : s) {
        uint64_t key = (static_cast<uint64_t>(node) << 8) | static_cast<unsigned char>(c);
        auto it = edges_.find(key);
        if (it == edges_.end()) {
          trie_.push_back(Node{});
          it = edges_.emplace(key, static_cast<int32_t>(trie_.size() - 1)).first;
        }
        node = it->second;
      }
      trie_[node].token = id;
    }
  }

  size_t size() const { return offsets_.size() - 1; }

  std::string_view token(int32_t id) const {
    return std::string_view(bytes_.data() + offsets_[id], offsets_[id + 1] - offsets_[id]);
  }

  int32_t lookup(const char* p, size_t n) const {
    size_t slot = mix(fnv(kFnvOffset, p, n)) & mask_;
    while (uint32_t e = table_[slot]) {
      std::string_view t = token(static_cast<int32_t>(e - 1));
      if (t.size() == n && std::memcmp(t.data(), p, n) == 0) return static_cast<int32_t>(e - 1);
      slot = (slot + 1) & mask_;
    }
    return -1;
  }

  // The token spelled token(a) + token(b), or -1.
  int32_t lookup_pair(int32_t a, int32_t b) const {
    std::string_view l = token(a), r = token(b);
    size_t slot = mix(fnv(fnv(kFnvOffset, l.data(), l.size()), r.data(), r.size())) & mask_;
    const size_t n = l.size() + r.size();
    while (uint32_t e = table_[slot]) {
      std::string_view t = token(static_cast<int32_t>(e - 1));
      if (t.size() == n && std::memcmp(t.data(), l.data(), l.size()) == 0 &&
          std::memcmp(t.data() + l.size(), r.data(), r.size()) == 0)
        return static_cast<int32_t>(e - 1);
      slot = (slot + 1) & mask_;
    }
    return -1;
  }

  // A merge's rank: its token's position, then the longer left part first.
  uint64_t rank(int32_t new_id, int32_t left) const {
    return (static_cast<uint64_t>(new_id) << 32) | (0xFFFFFFFFu - token(left).size());
  }

  void encode(const std::string& text, bool plain, std::vector<int32_t>& out) const {
    PairCache cache(text.size());
    size_t start = 0, i = 0;
    const size_t n = text.size();
    while (i < n) {
      if (!first_[static_cast<unsigned char>(text[i])]) {
        ++i;
        continue;
      }
      int32_t node = 0, found = -1;
      size_t end = i;
      for (size_t j = i; j < n; ++j) {
        uint64_t key = (static_cast<uint64_t>(node) << 8) | static_cast<unsigned char>(text[j]);
        auto it = edges_.find(key);
        if (it == edges_.end()) break;
        node = it->second;
        if (trie_[node].token >= 0) {
          found = trie_[node].token;
          end = j + 1;
        }
      }
      if (found < 0) {
        ++i;
        continue;
      }
      if (plain && (flags_[found] & kPlainText)) {  // consumed, but left in the text
        i = end;
        continue;
      }
      if (i > start) encode_word(text, start, i, cache, out);
      out.push_back(found);
      start = i = end;
    }
    if (n > start) encode_word(text, start, n, cache, out);
  }

  // ids -> text: Replace("\u2581", " "), ByteFallback, Fuse; ids past the vocabulary dropped,
  // ids no u32 holds an OverflowError (as the library).
  std::string decode(const std::vector<int64_t>& ids, bool skip_special) const {
    for (int64_t id64 : ids)
      if (id64 < 0 || id64 > int64_t{0xFFFFFFFF})
        throw std::overflow_error(id64 < 0 ? "number too small to fit in target type"
                                           : "number too large to fit in target type");
    std::string out, run;
    for (int64_t id64 : ids) {
      if (static_cast<size_t>(id64) >= size()) continue;
      int32_t id = static_cast<int32_t>(id64);
      if (skip_special && (flags_[id] & kSpecial)) continue;
      auto b = byte_of_.find(id);
      if (b != byte_of_.end()) {
        run.push_back(static_cast<char>(b->second));
        continue;
      }
      flush(run, out);
      append_decoded(id, out);
    }
    flush(run, out);
    return out;
  }

  size_t max_token_chars() const {
    size_t best = 0;
    for (size_t id = 0; id < size(); ++id) {
      std::string_view s = token(static_cast<int32_t>(id));
      size_t chars = 0;
      for (unsigned char c : s) chars += (c & 0xC0) != 0x80;
      best = std::max(best, chars);
    }
    return best;
  }

  size_t nbytes() const {
    return bytes_.capacity() + offsets_.capacity() * sizeof(uint32_t) +
           table_.capacity() * sizeof(uint32_t) + flags_.capacity() +
           trie_.capacity() * sizeof(Node) + edges_.size() * 32 + byte_of_.size() * 32;
  }

 private:
  static constexpr uint8_t kAdded = 1, kSpecial = 2, kPlainText = 4;

  struct Node {
    int32_t token = -1;
  };

  std::string decoded_piece(int32_t id) const {
    std::string out;
    append_decoded(id, out);
    return out;
  }

  void append_decoded(int32_t id, std::string& out) const {
    std::string_view s = token(id);
    size_t i = 0;
    while (i < s.size()) {
      if (i + 3 <= s.size() && s.compare(i, 3, kSpace) == 0) {
        out.push_back(' ');
        i += 3;
      } else {
        out.push_back(s[i++]);
      }
    }
  }

  static void flush(std::string& run, std::string& out) {
    if (run.empty()) return;
    if (valid_utf8(run)) {
      out += run;
    } else {
      for (size_t k = 0; k < run.size(); ++k) out += "\xef\xbf\xbd";  // one U+FFFD per byte
    }
    run.clear();
  }

  void encode_word(const std::string& text, size_t begin, size_t end, PairCache& cache,
                   std::vector<int32_t>& out) const {
    auto pair = [this, &cache](int32_t a, int32_t b) {
      return cache.get(a, b, [this](int32_t x, int32_t y) { return lookup_pair(x, y); });
    };
    std::vector<Symbol> symbols;
    symbols.reserve(end - begin);
    auto add = [&symbols](int32_t id, int32_t len) {
      int32_t index = static_cast<int32_t>(symbols.size());
      symbols.push_back(Symbol{id, index - 1, -1, len});
      if (index > 0) symbols[index - 1].next = index;
    };
    int32_t unk_len = -1;  // a pending (fused) unknown token's byte length
    size_t i = begin;
    while (i < end) {
      const unsigned char c = static_cast<unsigned char>(text[i]);
      size_t len = std::min(char_len(c), end - i);
      const int32_t id = c < 0x80 ? ascii_ids_[c] : lookup(text.data() + i, len);
      if (id >= 0) {
        if (unk_len >= 0) {
          add(unk_id_, unk_len);
          unk_len = -1;
        }
        add(id, static_cast<int32_t>(c == ' ' ? 3 : len));
      } else {
        // NOTE: the bytes of the character as normalized ("\u2581" for a space).
        const char* p = c == ' ' ? kSpace : text.data() + i;
        size_t plen = c == ' ' ? 3 : len;
        bool all = true;
        for (size_t k = 0; k < plen; ++k) all = all && byte_ids_[static_cast<unsigned char>(p[k])] >= 0;
        if (all) {
          for (size_t k = 0; k < plen; ++k) add(byte_ids_[static_cast<unsigned char>(p[k])], 1);
        } else if (unk_id_ >= 0) {
          unk_len = unk_len >= 0 ? unk_len + static_cast<int32_t>(plen) : static_cast<int32_t>(plen);
        }
      }
      i += len;
    }
    if (unk_len >= 0) add(unk_id_, unk_len);
    if (symbols.empty()) return;

    std::priority_queue<Merge, std::vector<Merge>, MergeAfter> queue;
    auto push = [&](int32_t pos, int32_t a, int32_t b) {
      int32_t t = pair(a, b);
      if (t >= 0) queue.push(Merge{rank(t, a), pos, t, a, b});
    };
    for (size_t k = 0; k + 1 < symbols.size(); ++k)
      push(static_cast<int32_t>(k), symbols[k].id, symbols[k + 1].id);
    while (!queue.empty()) {
      Merge top = queue.top();
      queue.pop();
      Symbol& cur = symbols[top.pos];
      if (cur.len == 0 || cur.next == -1) continue;
      const int32_t next_pos = cur.next;
      const Symbol right = symbols[next_pos];
      // A stale entry: the pair there now does not make the same token (the library's test;
      // the same ids as when queued make it, by construction).
      if ((cur.id != top.left || right.id != top.right) && pair(cur.id, right.id) != top.new_id)
        continue;
      cur.id = top.new_id;
      cur.len += right.len;
      cur.next = right.next;
      symbols[next_pos].len = 0;
      if (right.next >= 0) symbols[right.next].prev = top.pos;
      if (cur.prev >= 0) push(cur.prev, symbols[cur.prev].id, cur.id);
      if (cur.next >= 0) push(top.pos, cur.id, symbols[cur.next].id);
    }
    for (const Symbol& s : symbols)
      if (s.len != 0) out.push_back(s.id);
  }

  int32_t unk_id_;
  std::string bytes_;
  std::vector<uint32_t> offsets_;
  std::vector<uint32_t> table_;  // id + 1, 0 = empty
  size_t mask_ = 0;
  int32_t byte_ids_[256];
  int32_t ascii_ids_[0x80];
  std::unordered_map<int32_t, uint8_t> byte_of_;
  std::vector<uint8_t> flags_;
  std::vector<Node> trie_{Node{}};
  std::unordered_map<uint64_t, int32_t> edges_;
  bool first_[256] = {};
};

std::string utf8_of(const py::handle& text) {
  Py_ssize_t len = 0;
  const char* p = PyUnicode_AsUTF8AndSize(text.ptr(), &len);
  if (p == nullptr) throw py::error_already_set();
  return std::string(p, static_cast<size_t>(len));
}

}  // namespace

PYBIND11_MODULE(_spm_native, m) {
  m.doc() = "Compact SentencePiece BPE for vocabularies without merges (see tokenizer.py).";
  py::class_<SpmBpe>(m, "SpmBpe")
      .def(py::init<const py::list&, int32_t>(), py::arg("tokens"), py::arg("unk_id"))
      .def("set_added", &SpmBpe::set_added, py::arg("ids"), py::arg("special"),
           py::arg("plain_text"))
      .def("__len__", &SpmBpe::size)
      .def("token_to_id",
           [](const SpmBpe& s, const py::str& token) -> py::object {
             const std::string t = utf8_of(token);  // a lone surrogate: UnicodeEncodeError
             int32_t id = s.lookup(t.data(), t.size());
             return id < 0 ? py::object(py::none()) : py::object(py::int_(id));
           })
      .def("id_to_token",
           [](const SpmBpe& s, int64_t id) -> py::object {
             if (id < 0 || static_cast<size_t>(id) >= s.size()) return py::none();
             std::string_view t = s.token(static_cast<int32_t>(id));
             return py::str(t.data(), t.size());
           })
      .def(
          "encode_batch",
          [](const SpmBpe& s, const py::list& texts, bool plain) {
            std::vector<std::string> utf8;
            utf8.reserve(texts.size());
            for (const py::handle& t : texts) utf8.push_back(utf8_of(t));
            std::vector<std::vector<int32_t>> out(utf8.size());
            {
              py::gil_scoped_release release;
              for (size_t k = 0; k < utf8.size(); ++k) s.encode(utf8[k], plain, out[k]);
            }
            return out;
          },
          py::arg("texts"), py::arg("plain"))
      .def(
          "decode",
          [](const SpmBpe& s, const std::vector<int64_t>& ids, bool skip_special) {
            std::string text = s.decode(ids, skip_special);
            return py::str(text.data(), text.size());
          },
          py::arg("ids"), py::arg("skip_special"))
      .def("max_token_chars", &SpmBpe::max_token_chars)
      .def_property_readonly("nbytes", &SpmBpe::nbytes);
}
