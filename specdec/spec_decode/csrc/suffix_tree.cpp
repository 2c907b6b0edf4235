// Native suffix trees for suffix decoding: specdec.spec_decode._suffix_native.
//
// A line-by-line port of the Python reference ``SuffixTree`` in specdec/spec_decode/suffix.py
// (read its docstrings first): the same nodes, the same counts, the same ``best`` child and tie
// rules, so drafts are identical token for token and probability for probability. What changes
// is the representation:
//
// * nodes live in one arena (``std::vector<Node>``) and are named by index; freed nodes go on a
//   free list and are reused;
// * a node's children are found through one open-addressing hash map (parent, token) -> child
//   for the whole tree, and iterated through an intrusive doubly linked sibling list (needed only
//   to recompute ``best`` after removals and to free a subtree);
// * sequences are numbered internally by "slot", in the order they were added. Slots increase
//   like the Python sequence ids do, so the ``ref_seq`` tie key compares the same way;
// * cursors (the Python ``State`` lists) never leave C++: an open sequence keeps its cursor inside
//   the tree, and a cursor over another tree (a request's position in the global tree) is an
//   opaque ``Cursor`` that remembers the tree epoch it was built at.
//
// The Python code stays the reference and the fallback; tests/unit/spec_decode/test_suffix_native.py drives
// both through the same operations and compares everything.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int32_t kNone = -1;

// One node, as the Python ``_Node``: the path from the root to ``depth``, and its prefixes longer
// than the parent's depth (the edge). ``count`` = occurrences. A node seen at least twice (and the
// root) has all its children materialized; ``cont`` is the sum of their counts and ``best`` the most
// frequent one (ties: the most recent), or kNone when unknown (recomputed on demand). A node seen
// once has no children: its continuation is read from its sequence. ``ref_seq``/``ref_end`` is the
// most recent occurrence: token at ``depth`` = seq(ref_seq)[ref_end].
struct Node {
  int32_t token;  // first token of the edge (the key in the parent)
  int32_t depth;
  int32_t count;
  int32_t cont;
  int32_t best;
  int32_t ref_seq;  // a slot, see SuffixTree::seq_at
  int32_t ref_end;
  int32_t first_child;  // sibling list of the children (order is irrelevant: see recompute_best)
  int32_t next_sib;     // also the free-list link of a freed node
  int32_t prev_sib;
};

// A position while reading a sequence: either depth lies on node's edge (parent depth < depth <=
// node.depth), or node was seen once and the path goes on past node.depth in its sequence.
struct State {
  int32_t node;
  int32_t depth;
};

// Bytes per live node for the memory estimate: the 40-byte Node, its hash slot (12 bytes at a load
// factor of 0.35-0.7) and the arena's growth slack. RSS measured on trees of 0.14M-2.1M nodes
// (natural-ish text, 256-token responses in a global tree, or one long request; see
// bench_out/s4/native_memory.py): 63-71 bytes per node beyond the 4 bytes per stored token. 72
// errs on the high side (estimates 1.0-1.15x RSS).
constexpr int64_t kBytesPerNode = 72;
constexpr int64_t kBytesPerToken = 4;

// (parent, token) -> child, open addressing with linear probing and backward-shift deletion (no
// tombstones). An empty slot has child == kNone.
class EdgeMap {
 public:
  EdgeMap() { rehash(16); }

  int32_t find(int32_t parent, int32_t token) const {
    for (size_t i = home(parent, token);; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.child == kNone) return kNone;
      if (s.parent == parent && s.token == token) return s.child;
    }
  }

  // The key must be absent.
  void insert(int32_t parent, int32_t token, int32_t child) {
    if ((size_ + 1) * 10 > slots_.size() * 7) rehash(slots_.size() * 2);
    place(parent, token, child);
    ++size_;
  }

  // The key must be present.
  void erase(int32_t parent, int32_t token) {
    size_t i = home(parent, token);
    while (!(slots_[i].parent == parent && slots_[i].token == token)) {
      if (slots_[i].child == kNone) throw std::logic_error("suffix tree: erasing a missing edge");
      i = (i + 1) & mask_;
    }
    // Backward shift: pull later entries of the probe run into the hole when their home slot
    // does not lie cyclically in (hole, j].
    for (size_t j = (i + 1) & mask_; slots_[j].child != kNone; j = (j + 1) & mask_) {
      const size_t h = home(slots_[j].parent, slots_[j].token);
      const bool between = (i <= j) ? (i < h && h <= j) : (i < h || h <= j);
      if (!between) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i].child = kNone;
    --size_;
    if (slots_.size() > 64 && size_ * 8 < slots_.size()) rehash(slots_.size() / 2);
  }

  size_t capacity_bytes() const { return slots_.size() * sizeof(Slot); }

 private:
  struct Slot {
    int32_t parent;
    int32_t token;
    int32_t child;
  };

  size_t home(int32_t parent, int32_t token) const {
    uint64_t k = (uint64_t(uint32_t(parent)) << 32) | uint32_t(token);
    k ^= k >> 33;  // murmur3 finalizer
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return size_t(k) & mask_;
  }

  void place(int32_t parent, int32_t token, int32_t child) {
    size_t i = home(parent, token);
    while (slots_[i].child != kNone) i = (i + 1) & mask_;
    slots_[i] = Slot{parent, token, child};
  }

  void rehash(size_t n) {
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(n, Slot{0, 0, kNone});
    mask_ = n - 1;
    for (const Slot& s : old)
      if (s.child != kNone) place(s.parent, s.token, s.child);
  }

  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

// ``sum(probs)`` exactly as this Python computes it (the scores compare with ``>``): left to
// right before 3.12, Neumaier-compensated from 3.12 on (bltinmodule.c, builtin_sum_impl).
double python_sum(const std::vector<double>& xs) {
  if (xs.empty()) return 0.0;
  double f = 0.0 + xs[0];
#if PY_VERSION_HEX >= 0x030C0000
  double c = 0.0;
  for (size_t i = 1; i < xs.size(); ++i) {
    const double x = xs[i];
    const double t = f + x;
    if (std::fabs(f) >= std::fabs(x))
      c += (f - t) + x;
    else
      c += (x - t) + f;
    f = t;
  }
  if (c != 0.0 && std::isfinite(c)) f += c;
#else
  for (size_t i = 1; i < xs.size(); ++i) f += xs[i];
#endif
  return f;
}

// A read-only position of some sequence in a tree (the Python ``list[State]`` returned by
// ``match_states`` / ``follow``), valid only in the tree ``tree_uid`` while its epoch is ``epoch``
// (node indices mean nothing elsewhere: every use checks both).
struct Cursor {
  std::vector<State> states;  // longest match first
  int64_t epoch = -1;
  uint64_t tree_uid = 0;
};

struct Draft {
  std::vector<int32_t> tokens;
  std::vector<double> probs;  // running probability after each token
};

class SuffixTree {
 public:
  explicit SuffixTree(int max_depth) : max_depth_(max_depth), uid_(next_uid()) {
    if (max_depth < 1)
      throw std::invalid_argument("max_depth must be >= 1, got " + std::to_string(max_depth));
    root_ = alloc(-1, 0, -1, -1);
    nodes_[root_].count = 0;
  }

  int max_depth() const { return max_depth_; }
  // Whether ``cur`` was matched in this tree since its last change.
  bool is_current(const Cursor& cur) const { return cur.tree_uid == uid_ && cur.epoch == epoch_; }
  int64_t epoch() const { return epoch_; }
  int64_t num_nodes() const { return live_; }
  int64_t num_tokens() const { return num_tokens_; }
  int64_t approx_bytes() const { return live_ * kBytesPerNode + num_tokens_ * kBytesPerToken; }
  // What the containers hold right now (capacity, not just live entries): for measurements.
  int64_t allocated_bytes() const {
    int64_t total = int64_t(nodes_.capacity() * sizeof(Node)) + int64_t(edges_.capacity_bytes());
    for (const Seq& s : seqs_)
      total += int64_t(s.toks.capacity() * sizeof(int32_t) + s.states.capacity() * sizeof(State));
    return total;
  }

  // ---- incremental updates (a request's own tree) ---------------------------------------------
  void extend(int64_t seq_id, const std::vector<int32_t>& tokens) {
    int64_t slot = find_slot(seq_id);
    if (slot < 0) {
      slot = new_seq(seq_id, /*compressed=*/false);
      seq_at(slot).open = true;
    } else if (!seq_at(slot).open) {
      throw py::key_error("sequence " + std::to_string(seq_id) + " is closed");
    }
    for (int32_t t : tokens) append(slot, t);
    ++epoch_;
  }

  void close(int64_t seq_id) {
    const int64_t slot = find_slot(seq_id);
    if (slot < 0) return;
    Seq& s = seq_at(slot);
    s.open = false;
    std::vector<State>().swap(s.states);
  }

  // ---- whole sequences (the global tree) ------------------------------------------------------
  void add_sequence(int64_t seq_id, const std::vector<int32_t>& tokens) {
    const int64_t slot = new_seq(seq_id, /*compressed=*/true);
    seq_at(slot).toks = tokens;
    const int64_t n = int64_t(tokens.size());
    for (int64_t start = 0; start < n; ++start)
      insert_suffix(slot, start, std::min<int64_t>(max_depth_, n - start));
    num_tokens_ += n;
    ++epoch_;
  }

  // Remove the oldest sequence: every count it contributed goes away.
  void remove(int64_t seq_id) {
    if (seqs_.empty() || seqs_.front().id != seq_id)
      throw std::invalid_argument("only the oldest sequence can be removed, not " +
                                  std::to_string(seq_id));
    const std::vector<int32_t>& s = seqs_.front().toks;
    const int64_t n = int64_t(s.size());
    for (int64_t start = 0; start < n; ++start)
      remove_suffix(s, start, std::min<int64_t>(n, start + max_depth_));
    num_tokens_ -= n;
    slot_of_.erase(seq_id);
    seqs_.pop_front();
    ++first_slot_;
    ++epoch_;
  }

  // ---- reading --------------------------------------------------------------------------------
  bool has_seq(int64_t seq_id) const { return find_slot(seq_id) >= 0; }

  std::vector<int64_t> seq_ids() const {
    std::vector<int64_t> out;
    for (const Seq& s : seqs_) out.push_back(s.id);
    return out;
  }

  const std::vector<int32_t>& tokens_of(int64_t seq_id) const { return seq_at(slot_or_throw(seq_id)).toks; }

  // Occurrences of ``path`` (0 if longer than max_depth); count([]) = all tokens.
  int64_t count(const std::vector<int32_t>& path) const {
    if (int64_t(path.size()) > max_depth_) return 0;
    int32_t node = root_;
    for (int32_t d = 0; d < int32_t(path.size()); ++d) {
      const Node& n = nodes_[node];
      if (d < n.depth || (node != root_ && n.count < 2)) {
        int32_t tok;
        if (!token_at(node, d + 1, &tok) || tok != path[d]) return 0;
      } else {
        node = edges_.find(node, path[d]);
        if (node == kNone) return 0;
      }
    }
    return nodes_[node].count;
  }

  // The cursor of an open sequence, brought down to the nodes that now hold each suffix.
  std::vector<State>& suffix_states(int64_t seq_id) {
    Seq& s = seq_at(slot_or_throw(seq_id));
    if (!s.open) throw py::key_error("sequence " + std::to_string(seq_id) + " is closed");
    const int64_t p = int64_t(s.toks.size());
    for (State& st : s.states) st.node = descend(st.node, st.depth, s.toks, p);
    return s.states;
  }

  // The open sequence's suffixes that can draft from its own tree (see best_draft).
  void own_candidates(int64_t seq_id, std::vector<State>& out) {
    out.clear();
    for (const State& st : suffix_states(seq_id)) {
      const Node& n = nodes_[st.node];
      if (n.depth == st.depth && n.count >= 2) out.push_back(st);
    }
  }

  // Read-only cursor step: positions of a sequence's suffixes after one more token ``t``.
  void follow(std::vector<State>& states, int32_t t) const {
    size_t kept = 0;
    for (const State& st : states) {
      int32_t node = st.node;
      const Node& n = nodes_[node];
      if (st.depth < n.depth || n.count < 2) {
        int32_t tok;
        if (!token_at(node, st.depth + 1, &tok) || tok != t) continue;
      } else {
        node = edges_.find(node, t);
        if (node == kNone) continue;
      }
      if (st.depth + 1 < max_depth_) states[kept++] = State{node, st.depth + 1};
    }
    states.resize(kept);
    const int32_t child = edges_.find(root_, t);
    if (child != kNone && max_depth_ > 1) states.push_back(State{child, 1});
  }

  void cursor_follow(Cursor& cur, const std::vector<int32_t>& tokens) const {
    if (!is_current(cur))
      throw std::invalid_argument("stale cursor: the tree changed (or is another); match again");
    for (int32_t t : tokens) follow(cur.states, t);
  }

  // Positions of every suffix (shorter than max_depth) of ``tokens``; stamps the current epoch.
  void cursor_match(Cursor& cur, const std::vector<int32_t>& tokens) const {
    cur.states.clear();
    const int64_t n = int64_t(tokens.size());
    for (int64_t i = std::max<int64_t>(0, n - max_depth_ + 1); i < n; ++i)
      follow(cur.states, tokens[i]);
    cur.epoch = epoch_;
    cur.tree_uid = uid_;
  }

  // Follow the most frequent continuation from a position while the running probability stays
  // >= min_token_prob; at most max_tokens and never past max_depth. (Python: ``draft``.) Not
  // const: like the Python code it caches a recomputed ``best``, which later updates build on.
  void draft(State st, int64_t max_tokens, double min_token_prob, Draft& out) {
    out.tokens.clear();
    out.probs.clear();
    int32_t node = st.node;
    int64_t d = st.depth;
    const int64_t limit = std::min<int64_t>(max_tokens, max_depth_ - d);
    double run = 1.0;
    while (int64_t(out.tokens.size()) < limit) {
      const Node& n = nodes_[node];
      if (d < n.depth || n.count < 2) {  // a run every occurrence shares, or just one occurrence
        const std::vector<int32_t>& s = seq_at(n.ref_seq).toks;
        const int64_t start = int64_t(n.ref_end) + d + 1 - n.depth;
        int64_t want = limit - int64_t(out.tokens.size());
        if (n.count >= 2) want = std::min<int64_t>(want, n.depth - d);
        const int64_t got = std::max<int64_t>(0, std::min<int64_t>(want, int64_t(s.size()) - start));
        for (int64_t i = 0; i < got; ++i) {
          out.tokens.push_back(s[start + i]);
          out.probs.push_back(run);
        }
        if (n.count < 2 || got < want) break;
        d += got;
        continue;
      }
      if (n.cont == 0) break;
      const int32_t child = n.best != kNone ? n.best : recompute_best(node);
      run *= double(nodes_[child].count) / double(nodes_[node].cont);
      if (run < min_token_prob) break;
      out.tokens.push_back(nodes_[child].token);
      out.probs.push_back(run);
      node = child;
      d += 1;
    }
  }

  // Materialized nodes: (path of edge keys, depth, count, cont). For tests.
  std::vector<std::tuple<std::vector<int32_t>, int32_t, int32_t, int32_t>> dump() const {
    std::vector<std::tuple<std::vector<int32_t>, int32_t, int32_t, int32_t>> out;
    std::vector<std::pair<int32_t, std::vector<int32_t>>> stack{{root_, {}}};
    while (!stack.empty()) {
      auto [node, path] = std::move(stack.back());
      stack.pop_back();
      const Node& n = nodes_[node];
      out.emplace_back(path, n.depth, n.count, n.cont);
      for (int32_t c = n.first_child; c != kNone; c = nodes_[c].next_sib) {
        std::vector<int32_t> p = path;
        p.push_back(nodes_[c].token);
        stack.emplace_back(c, std::move(p));
      }
    }
    return out;
  }

 private:
  struct Seq {
    int64_t id;
    std::vector<int32_t> toks;
    std::vector<State> states;  // an open sequence's suffixes shorter than max_depth, longest first
    bool open = false;
  };

  // ---- storage --------------------------------------------------------------------------------
  int32_t alloc(int32_t token, int32_t depth, int32_t ref_seq, int32_t ref_end) {
    int32_t idx;
    if (free_head_ != kNone) {
      idx = free_head_;
      free_head_ = nodes_[idx].next_sib;
    } else {
      idx = int32_t(nodes_.size());
      nodes_.emplace_back();
    }
    nodes_[idx] = Node{token, depth, 1, 0, kNone, ref_seq, ref_end, kNone, kNone, kNone};
    ++live_;
    return idx;
  }

  void release(int32_t idx) {
    nodes_[idx].count = -1;  // poison: a freed node must never be read again
    nodes_[idx].next_sib = free_head_;
    free_head_ = idx;
    --live_;
  }

  // Makes ``child`` (keyed by its token) a child of ``parent``.
  void link(int32_t parent, int32_t child) {
    Node& p = nodes_[parent];
    Node& c = nodes_[child];
    c.prev_sib = kNone;
    c.next_sib = p.first_child;
    if (p.first_child != kNone) nodes_[p.first_child].prev_sib = child;
    p.first_child = child;
    edges_.insert(parent, c.token, child);
  }

  void unlink(int32_t parent, int32_t child) {
    Node& c = nodes_[child];
    edges_.erase(parent, c.token);
    if (c.prev_sib != kNone)
      nodes_[c.prev_sib].next_sib = c.next_sib;
    else
      nodes_[parent].first_child = c.next_sib;
    if (c.next_sib != kNone) nodes_[c.next_sib].prev_sib = c.prev_sib;
    c.prev_sib = c.next_sib = kNone;
  }

  // Frees every node below ``node`` (not ``node`` itself).
  void free_subtree_below(int32_t node) {
    std::vector<int32_t> stack{node};
    while (!stack.empty()) {
      const int32_t x = stack.back();
      stack.pop_back();
      int32_t c = nodes_[x].first_child;
      while (c != kNone) {
        const int32_t next = nodes_[c].next_sib;
        edges_.erase(x, nodes_[c].token);
        stack.push_back(c);  // its own children are read before it is released below
        c = next;
      }
      nodes_[x].first_child = kNone;
      if (x != node) release(x);
    }
  }

  bool has_one_child(int32_t node) const {
    const int32_t f = nodes_[node].first_child;
    return f != kNone && nodes_[f].next_sib == kNone;
  }

  int64_t find_slot(int64_t seq_id) const {
    auto it = slot_of_.find(seq_id);
    return it == slot_of_.end() ? -1 : it->second;
  }

  int64_t slot_or_throw(int64_t seq_id) const {
    const int64_t slot = find_slot(seq_id);
    if (slot < 0) throw py::key_error("no sequence " + std::to_string(seq_id));
    return slot;
  }

  // NOTE: a live node's ref is a live sequence (its most recent occurrence; FIFO removal drops the
  // oldest). Checked anyway: a bad slot must raise, not read freed memory.
  Seq& seq_at(int64_t slot) {
    if (slot < first_slot_ || slot - first_slot_ >= int64_t(seqs_.size()))
      throw std::logic_error("suffix tree: reference to a removed sequence");
    return seqs_[size_t(slot - first_slot_)];
  }
  const Seq& seq_at(int64_t slot) const { return const_cast<SuffixTree*>(this)->seq_at(slot); }

  static uint64_t next_uid() {
    static uint64_t counter = 0;  // under the GIL
    return ++counter;
  }

  int64_t new_seq(int64_t seq_id, bool compressed) {
    if (compressed_ == -1)
      compressed_ = compressed ? 1 : 0;
    else if (compressed_ != (compressed ? 1 : 0))
      throw std::invalid_argument("a tree takes either extend() or add_sequence(), not both");
    if (seq_id <= last_seq_id_)
      throw std::invalid_argument("new sequence ids must increase (FIFO eviction relies on it)");
    last_seq_id_ = seq_id;
    const int64_t slot = first_slot_ + int64_t(seqs_.size());
    if (slot > INT32_MAX) throw std::overflow_error("suffix tree: too many sequences");
    seqs_.push_back(Seq{seq_id, {}, {}, false});
    slot_of_[seq_id] = slot;
    return slot;
  }

  // The token at ``depth`` on node's path (past node.depth: only for nodes seen once); false if
  // the reference sequence ends before it.
  bool token_at(int32_t node, int64_t depth, int32_t* out) const {
    const Node& n = nodes_[node];
    const std::vector<int32_t>& s = seq_at(n.ref_seq).toks;
    const int64_t i = int64_t(n.ref_end) + depth - n.depth;
    if (i >= int64_t(s.size())) return false;
    *out = s[i];
    return true;
  }

  // From a state's node down to the node that now holds depth d of the suffix ending before
  // position p of ``toks`` (the tree may have grown under the path since the state was made).
  int32_t descend(int32_t node, int32_t d, const std::vector<int32_t>& toks, int64_t p) const {
    while (nodes_[node].depth < d && nodes_[node].count >= 2) {
      node = edges_.find(node, toks[p - d + nodes_[node].depth]);
      if (node == kNone) throw std::logic_error("suffix tree: cursor lost its path");
    }
    return node;
  }

  // ``child`` just gained an occurrence (the most recent): keep parent's ``best`` right.
  void update_best(int32_t parent, int32_t child) {
    Node& p = nodes_[parent];
    if (p.best == kNone) {
      if (has_one_child(parent)) p.best = child;
    } else if (nodes_[child].count >= nodes_[p.best].count) {
      p.best = child;
    }
  }

  // Ties: the most recent occurrence (latest slot, then latest start). The key is unique among
  // siblings (two children cannot share their latest occurrence), so the sibling order is moot.
  int32_t recompute_best(int32_t node) {
    int32_t best = kNone;
    for (int32_t c = nodes_[node].first_child; c != kNone; c = nodes_[c].next_sib) {
      if (best == kNone) {
        best = c;
        continue;
      }
      const Node& a = nodes_[c];
      const Node& b = nodes_[best];
      if (std::make_tuple(a.count, a.ref_seq, a.ref_end - a.depth) >
          std::make_tuple(b.count, b.ref_seq, b.ref_end - b.depth))
        best = c;
    }
    nodes_[node].best = best;
    return best;
  }

  // ---- incremental updates --------------------------------------------------------------------
  // One token: each suffix of length < max_depth grows by ``t`` (one occurrence each).
  // NOTE: longest first. When a node reaches its second occurrence, the continuation of the first
  // one is materialized; if that continuation is this very token, its (longer) suffix was handled
  // just before, implicitly, and must not be counted twice.
  void append(int64_t slot, int32_t t) {
    Seq& s = seq_at(slot);  // deque elements stay put while the tree changes
    const int64_t p = int64_t(s.toks.size());
    s.toks.push_back(t);
    std::vector<State>& states = s.states;
    size_t kept = 0;
    for (size_t k = 0; k < states.size(); ++k) {
      int32_t d = states[k].depth;
      int32_t node = descend(states[k].node, d, s.toks, p);
      if (nodes_[node].depth == d && nodes_[node].count >= 2)
        node = add_occurrence(node, t, int32_t(slot), int32_t(p));
      ++d;
      if (d < max_depth_) states[kept++] = State{node, d};
    }
    states.resize(kept);
    nodes_[root_].count += 1;
    num_tokens_ += 1;
    const int32_t child = add_occurrence(root_, t, int32_t(slot), int32_t(p));
    if (max_depth_ > 1) states.push_back(State{child, 1});
  }

  // One more occurrence of parent's path + ``t``, ending at seq(slot)[end].
  int32_t add_occurrence(int32_t parent, int32_t t, int32_t slot, int32_t end) {
    int32_t child = edges_.find(parent, t);
    nodes_[parent].cont += 1;
    if (child == kNone) {
      child = alloc(t, nodes_[parent].depth + 1, slot, end);
      link(parent, child);
    } else {
      if (nodes_[child].count == 1) materialize(child);
      Node& c = nodes_[child];
      c.count += 1;
      c.ref_seq = slot;
      c.ref_end = end;
    }
    update_best(parent, child);
    return child;
  }

  // ``node`` gets its second occurrence: give the first one's continuation a node.
  void materialize(int32_t node) {
    const Node n = nodes_[node];
    const std::vector<int32_t>& s = seq_at(n.ref_seq).toks;
    const int64_t nxt = int64_t(n.ref_end) + 1;
    if (n.depth < max_depth_ && nxt < int64_t(s.size())) {
      const int32_t child = alloc(s[nxt], n.depth + 1, n.ref_seq, int32_t(nxt));
      link(node, child);
      nodes_[node].cont = 1;
      nodes_[node].best = child;
    }
  }

  // ---- whole sequences ------------------------------------------------------------------------
  // One suffix, seq[start:start + limit], top-down: follow shared runs, split where it leaves one.
  void insert_suffix(int64_t slot, int64_t start, int64_t limit) {
    const std::vector<int32_t>& s = seq_at(slot).toks;
    int32_t node = root_;
    nodes_[node].count += 1;
    int64_t d = 0;
    while (d < limit) {
      const int32_t t = s[start + d];
      nodes_[node].cont += 1;
      int32_t child = edges_.find(node, t);
      if (child == kNone) {
        child = alloc(t, int32_t(d + 1), int32_t(slot), int32_t(start + d));
        link(node, child);
        update_best(node, child);
        return;
      }
      if (nodes_[child].count == 1) {
        split_leaf(child, d, slot, start, limit);
        update_best(node, child);
        return;
      }
      // Follow the shared run while this suffix agrees with it; split where it leaves it.
      const Node& c = nodes_[child];
      const std::vector<int32_t>& ref = seq_at(c.ref_seq).toks;
      const int64_t offset = int64_t(c.ref_end) - c.depth - start + 1;  // ref index - seq index
      const int64_t stop = std::min<int64_t>(c.depth, limit);
      int64_t x = d + 1;
      while (x < stop && ref[start + x + offset] == s[start + x]) ++x;
      if (x < c.depth) child = split_edge(node, child, int32_t(x));
      Node& cc = nodes_[child];
      cc.count += 1;
      cc.ref_seq = int32_t(slot);
      cc.ref_end = int32_t(start + x - 1);
      update_best(node, child);
      node = child;
      d = x;
    }
  }

  // Cut ``node``'s run after ``depth``: a new node above takes the part up to ``depth``.
  int32_t split_edge(int32_t parent, int32_t node, int32_t depth) {
    const Node n = nodes_[node];
    const int32_t upper_end = n.ref_end - n.depth + depth;
    const int32_t upper = alloc(n.token, depth, n.ref_seq, upper_end);
    nodes_[upper].count = nodes_[upper].cont = n.count;
    unlink(parent, node);
    nodes_[node].token = seq_at(n.ref_seq).toks[size_t(upper_end) + 1];
    link(parent, upper);
    link(upper, node);
    nodes_[upper].best = node;
    if (nodes_[parent].best == node) nodes_[parent].best = upper;
    return upper;
  }

  // A node seen once meets a second occurrence, seq[start:start + limit], which entered it at
  // depth d + 1: their common run becomes the node, and each one that goes on gets a leaf.
  void split_leaf(int32_t leaf, int64_t d, int64_t slot, int64_t start, int64_t limit) {
    const Node l = nodes_[leaf];
    const int32_t old_slot = l.ref_seq;
    const std::vector<int32_t>& old = seq_at(old_slot).toks;
    const std::vector<int32_t>& s = seq_at(slot).toks;
    const int64_t offset = int64_t(l.ref_end) - l.depth - start + 1;  // old index - seq index
    int64_t x = d + 1;
    while (x < limit && start + x + offset < int64_t(old.size()) &&
           old[start + x + offset] == s[start + x])
      ++x;
    Node& nl = nodes_[leaf];
    nl.depth = int32_t(x);
    nl.count = 2;
    nl.ref_seq = int32_t(slot);
    nl.ref_end = int32_t(start + x - 1);
    const int64_t i = start + x + offset;
    int32_t newest = kNone;
    int32_t num_leaves = 0;
    if (x < max_depth_ && i < int64_t(old.size())) {
      newest = alloc(old[i], int32_t(x + 1), old_slot, int32_t(i));
      link(leaf, newest);
      ++num_leaves;
    }
    if (x < limit) {
      newest = alloc(s[start + x], int32_t(x + 1), int32_t(slot), int32_t(start + x));
      link(leaf, newest);
      ++num_leaves;
    }
    if (num_leaves) {
      nodes_[leaf].cont = num_leaves;
      nodes_[leaf].best = newest;  // ties: the most recent occurrence
    }
  }

  void remove_suffix(const std::vector<int32_t>& s, int64_t start, int64_t stop) {
    int32_t node = root_;
    nodes_[node].count -= 1;
    int64_t i = start;
    while (i < stop) {  // NOTE: every occurrence covers whole runs (split where one ends)
      const int32_t child = edges_.find(node, s[i]);
      if (child == kNone) throw std::logic_error("suffix tree: removing a path that is not there");
      nodes_[node].cont -= 1;
      nodes_[child].count -= 1;
      if (nodes_[node].best == child) nodes_[node].best = kNone;  // recomputed on demand
      if (nodes_[child].count == 0) {  // it was seen once: no children
        unlink(node, child);
        release(child);
        return;
      }
      if (nodes_[child].count == 1) {
        // NOTE: the survivor is the most recent occurrence (FIFO), so child's ref stays valid and
        // everything below can be read from its sequence again.
        free_subtree_below(child);
        nodes_[child].cont = 0;
        nodes_[child].best = kNone;
        return;
      }
      node = child;
      i = start + nodes_[child].depth;
    }
  }

  int max_depth_;
  uint64_t uid_;  // tells cursors of different trees apart
  std::vector<Node> nodes_;
  EdgeMap edges_;
  int32_t root_ = kNone;
  int32_t free_head_ = kNone;
  int64_t live_ = 0;
  std::deque<Seq> seqs_;  // oldest first; seqs_[i] has slot first_slot_ + i
  int64_t first_slot_ = 0;
  std::unordered_map<int64_t, int64_t> slot_of_;  // sequence id -> slot
  int compressed_ = -1;  // set by the first update: 1 = add_sequence, 0 = extend
  int64_t last_seq_id_ = -1;
  int64_t num_tokens_ = 0;
  int64_t epoch_ = 0;  // bumped on every change, so cursors know they are stale
};

// Candidates come longest match first; a later one must score strictly higher. (Python:
// ``SuffixProposer._best_of``.)
struct Params {
  int64_t cap;
  double max_spec_factor;
  double max_spec_offset;
  int64_t max_tree_depth;
  double min_token_prob;
};

struct Best {
  Draft draft;
  double score = 0.0;
  int64_t match_len = 0;
  const char* source = "";
};

int64_t draft_limit(const Params& prm, int64_t match_len) {
  // int(max_spec_factor * match_len + max_spec_offset + 1e-6), truncated like Python's int()
  const double v = prm.max_spec_factor * double(match_len) + prm.max_spec_offset + 1e-6;
  int64_t by_factor;
  if (v >= 9.0e18)
    by_factor = INT64_MAX;
  else if (v <= -9.0e18)
    by_factor = INT64_MIN;
  else
    by_factor = int64_t(v);
  return std::min({prm.cap, by_factor, prm.max_tree_depth - match_len});
}

void best_of(SuffixTree& tree, const std::vector<State>& candidates, const Params& prm,
             const char* source, Best& best, Draft& scratch) {
  for (const State& st : candidates) {
    const int64_t match_len = st.depth;
    const int64_t limit = draft_limit(prm, match_len);
    if (double(limit) <= best.score) continue;  // cannot beat the best (score <= #tokens)
    tree.draft(st, limit, prm.min_token_prob, scratch);
    if (scratch.tokens.empty()) continue;
    const double score = python_sum(scratch.probs);
    if (score > best.score) {
      std::swap(best.draft, scratch);
      best.score = score;
      best.match_len = match_len;
      best.source = source;
    }
  }
}

}  // namespace

PYBIND11_MODULE(_suffix_native, m) {
  m.doc() = "Native suffix trees for suffix decoding (see specdec/spec_decode/suffix.py).";
  m.attr("BYTES_PER_NODE") = kBytesPerNode;
  m.attr("BYTES_PER_TOKEN") = kBytesPerToken;
  m.def("python_sum", &python_sum, py::arg("values"),
        "sum(values) as this Python computes it (what best_draft compares scores with).");

  py::class_<Cursor>(m, "Cursor", "A sequence's position in another tree (opaque).")
      .def(py::init<>())
      .def_readonly("epoch", &Cursor::epoch)
      .def("depths", [](const Cursor& c) {
        std::vector<int32_t> out;
        for (const State& st : c.states) out.push_back(st.depth);
        return out;
      });

  py::class_<SuffixTree>(m, "SuffixTree")
      .def(py::init<int>(), py::arg("max_depth"))
      .def_property_readonly("max_depth", &SuffixTree::max_depth)
      .def_property_readonly("epoch", &SuffixTree::epoch)
      .def_property_readonly("num_nodes", &SuffixTree::num_nodes)
      .def_property_readonly("num_tokens", &SuffixTree::num_tokens)
      .def_property_readonly("approx_bytes", &SuffixTree::approx_bytes)
      .def_property_readonly("allocated_bytes", &SuffixTree::allocated_bytes)
      .def("memory_stats",
           [](const SuffixTree& t) {
             py::dict d;
             d["num_nodes"] = t.num_nodes();
             d["num_tokens"] = t.num_tokens();
             d["approx_bytes"] = t.approx_bytes();
             return d;
           })
      .def("extend", &SuffixTree::extend, py::arg("seq_id"), py::arg("tokens"))
      .def("close", &SuffixTree::close, py::arg("seq_id"))
      .def("add_sequence", &SuffixTree::add_sequence, py::arg("seq_id"), py::arg("tokens"))
      .def("remove", &SuffixTree::remove, py::arg("seq_id"))
      .def("seq_ids", &SuffixTree::seq_ids)
      .def("seq_len", [](const SuffixTree& t, int64_t id) {
        return t.has_seq(id) ? int64_t(t.tokens_of(id).size()) : int64_t(0);
      }, "Length of a sequence (0 if there is none).")
      .def("token", [](const SuffixTree& t, int64_t id, int64_t i) {
        const std::vector<int32_t>& s = t.tokens_of(id);
        if (i < 0) i += int64_t(s.size());
        if (i < 0 || i >= int64_t(s.size())) throw py::index_error("token index out of range");
        return s[size_t(i)];
      })
      .def("tokens", [](const SuffixTree& t, int64_t id, int64_t start) {
        const std::vector<int32_t>& s = t.tokens_of(id);
        start = std::clamp<int64_t>(start, 0, int64_t(s.size()));
        return std::vector<int32_t>(s.begin() + start, s.end());
      }, py::arg("seq_id"), py::arg("start") = 0)
      .def("count", &SuffixTree::count, py::arg("path"))
      .def("suffix_depths", [](SuffixTree& t, int64_t id) {
        std::vector<int32_t> out;
        for (const State& st : t.suffix_states(id)) out.push_back(st.depth);
        return out;
      })
      .def("suffix_draft", [](SuffixTree& t, int64_t id, size_t i, int64_t k, double p) {
        const std::vector<State>& states = t.suffix_states(id);
        if (i >= states.size()) throw py::index_error("state index out of range");
        Draft out;
        t.draft(states[i], k, p, out);
        return std::make_pair(out.tokens, out.probs);
      })
      .def("cursor_match", &SuffixTree::cursor_match, py::arg("cursor"), py::arg("tokens"))
      .def("cursor_follow", &SuffixTree::cursor_follow, py::arg("cursor"), py::arg("tokens"))
      .def("cursor_draft", [](SuffixTree& t, const Cursor& c, size_t i, int64_t k, double p) {
        if (!t.is_current(c)) throw std::invalid_argument("stale cursor");
        if (i >= c.states.size()) throw py::index_error("state index out of range");
        Draft out;
        t.draft(c.states[i], k, p, out);
        return std::make_pair(out.tokens, out.probs);
      })
      .def("dump", &SuffixTree::dump);

  m.def(
      "best_draft",
      [](SuffixTree& own, int64_t seq_id, SuffixTree* global, const Cursor* cursor, int64_t cap,
         double max_spec_factor, double max_spec_offset, int64_t max_tree_depth,
         double min_token_prob) {
        const Params prm{cap, max_spec_factor, max_spec_offset, max_tree_depth, min_token_prob};
        Best best;
        Draft scratch;
        // Own tree first: in it a request's suffix always occurs once (itself), so only nodes
        // seen at least twice that end at the suffix's depth have an earlier occurrence to
        // continue from.
        std::vector<State> candidates;
        own.own_candidates(seq_id, candidates);
        best_of(own, candidates, prm, "request", best, scratch);
        if (global != nullptr) {
          if (cursor == nullptr || !global->is_current(*cursor))
            throw std::invalid_argument("best_draft: the global cursor is stale");
          best_of(*global, cursor->states, prm, "global", best, scratch);
        }
        return py::make_tuple(best.draft.tokens, best.draft.probs, best.match_len,
                              std::string(best.source));
      },
      py::arg("own"), py::arg("seq_id"), py::arg("global_tree").none(true),
      py::arg("cursor").none(true), py::arg("cap"), py::arg("max_spec_factor"),
      py::arg("max_spec_offset"), py::arg("max_tree_depth"), py::arg("min_token_prob"),
      "Python: SuffixProposer._best_draft. Returns (tokens, probs, match_len, source).");
}
