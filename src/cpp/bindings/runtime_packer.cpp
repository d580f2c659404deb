// Bindings of the batch packer (src/cpp/runtime/batch_packer.h) and its
// request table. Thin: Python objects are read straight into reused scratch
// buffers (no per-step allocation) and passed to the C++ calls; outputs are
// read-only NumPy views of the packer's buffers (the packer owns them).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include <climits>
#include <string>
#include <string_view>
#include <vector>

#include "bindings/bindings.h"
#include "runtime/batch_packer.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace rt = vllm_metal::runtime;

namespace {

// ---- reading Python objects -----------------------------------------------------

std::string_view str_view(nb::handle h) {
  Py_ssize_t n = 0;
  const char* s = PyUnicode_Check(h.ptr()) ? PyUnicode_AsUTF8AndSize(h.ptr(), &n) : nullptr;
  if (!s) {
    PyErr_Clear();
    throw nb::type_error("[BatchPacker] request ids must be str");
  }
  return {s, static_cast<size_t>(n)};
}

int32_t to_int32(PyObject* o) {
  const long v = PyLong_AsLong(o);
  if (v == -1 && PyErr_Occurred()) throw nb::python_error();
  if (v < INT32_MIN || v > INT32_MAX) {
    throw nb::value_error(("[BatchPacker] expected an int32, got " + std::to_string(v)).c_str());
  }
  return static_cast<int32_t>(v);
}

// Appends the ints of a list / tuple / 1-D array-like to `out`.
void read_int32s(nb::handle obj, std::vector<int32_t>& out) {
  PyObject* o = obj.ptr();
  if (PyList_Check(o) || PyTuple_Check(o)) {
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
    PyObject** items = PySequence_Fast_ITEMS(o);
    const size_t base = out.size();
    out.resize(base + static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) out[base + static_cast<size_t>(i)] = to_int32(items[i]);
    return;
  }
  nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> a;
  if (nb::try_cast(obj, a, /*convert=*/true)) {
    out.insert(out.end(), a.data(), a.data() + a.shape(0));
    return;
  }
  for (nb::handle item : nb::iter(obj)) out.push_back(to_int32(item.ptr()));
}

// Per-group block-id lists: one flat scratch plus offsets, turned into spans
// once every list is in (the scratch may move while it grows).
struct BlockIdScratch {
  std::vector<int32_t> ids;
  std::vector<size_t> bounds;  // [lists + 1]
  std::vector<rt::Int32Span> spans;

  void clear() {
    ids.clear();
    bounds.assign(1, 0);
  }
  // Reads a tuple/list of num_groups lists.
  void read(nb::handle groups, int32_t num_groups) {
    const size_t n = static_cast<size_t>(nb::len(groups));
    if (n != static_cast<size_t>(num_groups)) {
      throw nb::value_error(("[BatchPacker] expected block ids for " + std::to_string(num_groups) +
                             " KV-cache groups, got " + std::to_string(n))
                                .c_str());
    }
    for (nb::handle list : nb::iter(groups)) {
      read_int32s(list, ids);
      bounds.push_back(ids.size());
    }
  }
  // Spans of all lists read so far; list i is spans[i].
  const rt::Int32Span* finish() {
    spans.resize(bounds.size() - 1);
    for (size_t i = 0; i + 1 < bounds.size(); ++i) {
      spans[i] = rt::Int32Span(ids.data() + bounds[i], bounds[i + 1] - bounds[i]);
    }
    return spans.data();
  }
};

struct Scratch {
  std::vector<int32_t> tokens;
  std::vector<int32_t> mrope;
  BlockIdScratch blocks;
  std::vector<rt::RequestUpdate> updates;
  std::vector<int64_t> update_block_list;  // update i -> first list index, or -1
  std::vector<size_t> update_token_bounds;  // update i -> [begin, end) in tokens, or npos
  std::vector<rt::Int32Span> update_tokens;
  std::vector<int32_t> drafts;
  std::vector<std::string_view> ids;
  std::vector<int32_t> counts;
  std::vector<size_t> draft_bounds;  // [2 * n]
  std::vector<rt::Int32Span> draft_spans;
};

Scratch& scratch() {
  static thread_local Scratch s;
  return s;
}

nb::object owner_of(const rt::BatchPacker& p) { return nb::find(&p); }

template <typename T>
nb::ndarray<nb::numpy, const T> view(const rt::BatchPacker& p, const T* data,
                                     std::initializer_list<size_t> shape) {
  return nb::ndarray<nb::numpy, const T>(data, shape, owner_of(p));
}

// ---- the bound calls ------------------------------------------------------------

int32_t add_request(rt::BatchPacker& p, nb::handle req_id, nb::handle token_ids,
                    int32_t num_computed_tokens, nb::handle block_ids, int32_t prompt_len,
                    nb::handle mrope_positions, int32_t mrope_position_delta, bool replace) {
  Scratch& s = scratch();
  s.tokens.clear();
  read_int32s(token_ids, s.tokens);
  rt::NewRequest r;
  r.req_id = str_view(req_id);
  r.token_ids = rt::Int32Span(s.tokens);
  r.prompt_len = prompt_len;
  r.num_computed_tokens = num_computed_tokens;
  s.blocks.clear();
  if (!block_ids.is_none()) {
    s.blocks.read(block_ids, p.requests().num_groups());
    r.block_ids = s.blocks.finish();
  }
  s.mrope.clear();
  if (!mrope_positions.is_none()) {
    nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> a;
    if (!nb::try_cast(mrope_positions, a, /*convert=*/true)) {
      throw nb::type_error("[BatchPacker] mrope_positions must be an integer array [dims, L]");
    }
    if (static_cast<int32_t>(a.shape(0)) != p.config().mrope_num_dims) {
      throw nb::value_error(("[BatchPacker] mrope_positions must have " +
                             std::to_string(p.config().mrope_num_dims) + " rows, got " +
                             std::to_string(a.shape(0)))
                                .c_str());
    }
    s.mrope.assign(a.data(), a.data() + a.size());
    r.mrope_positions = rt::Int32Span(s.mrope);
  }
  r.mrope_position_delta = mrope_position_delta;
  return p.requests().add(r, replace);
}

int32_t remove_requests(rt::BatchPacker& p, nb::handle req_ids) {
  int32_t removed = 0;
  for (nb::handle id : nb::iter(req_ids)) removed += p.requests().remove(str_view(id)) ? 1 : 0;
  return removed;
}

void update_requests(rt::BatchPacker& p, nb::handle req_ids, nb::handle num_computed_tokens,
                     nb::handle new_block_ids, nb::handle resumed_req_ids,
                     nb::handle num_output_tokens, nb::handle all_token_ids) {
  Scratch& s = scratch();
  const auto seq = [](nb::handle h, const char* name) {
    if (!PyList_Check(h.ptr()) && !PyTuple_Check(h.ptr())) {
      throw nb::type_error((std::string("[BatchPacker] ") + name + " must be a list").c_str());
    }
    return PySequence_Fast_ITEMS(h.ptr());
  };
  const size_t n = static_cast<size_t>(nb::len(req_ids));
  const auto check_len = [n](nb::handle h, const char* name) {
    if (static_cast<size_t>(nb::len(h)) != n) {
      throw nb::value_error((std::string("[BatchPacker] ") + name + " must have one entry per " +
                             "request id (" + std::to_string(n) + "), got " +
                             std::to_string(nb::len(h)))
                                .c_str());
    }
  };
  PyObject** ids = seq(req_ids, "req_ids");
  check_len(num_computed_tokens, "num_computed_tokens");
  PyObject** computed = seq(num_computed_tokens, "num_computed_tokens");
  PyObject** blocks = nullptr;
  if (!new_block_ids.is_none()) {
    check_len(new_block_ids, "new_block_ids");
    blocks = seq(new_block_ids, "new_block_ids");
  }
  PyObject** outputs = nullptr;
  if (!num_output_tokens.is_none()) {
    check_len(num_output_tokens, "num_output_tokens");
    outputs = seq(num_output_tokens, "num_output_tokens");
  }
  const bool any_resumed = !resumed_req_ids.is_none() && nb::len(resumed_req_ids) > 0;
  if (!all_token_ids.is_none() && !PyDict_Check(all_token_ids.ptr())) {
    throw nb::type_error("[BatchPacker] all_token_ids must be a dict {req_id: [int]}");
  }
  const bool any_tokens = !all_token_ids.is_none() && PyDict_GET_SIZE(all_token_ids.ptr()) > 0;
  const int32_t groups = p.requests().num_groups();

  s.updates.resize(n);
  s.blocks.clear();
  s.update_block_list.assign(n, -1);
  s.tokens.clear();
  s.update_token_bounds.assign(2 * n, SIZE_MAX);
  for (size_t i = 0; i < n; ++i) {
    rt::RequestUpdate& u = s.updates[i];
    u = rt::RequestUpdate{};
    nb::handle id(ids[i]);
    u.req_id = str_view(id);
    u.num_computed_tokens = to_int32(computed[i]);
    if (blocks && blocks[i] != Py_None) {
      s.update_block_list[i] = static_cast<int64_t>(s.blocks.bounds.size() - 1);
      s.blocks.read(blocks[i], groups);
    }
    if (any_resumed) {
      const int c = PySequence_Contains(resumed_req_ids.ptr(), ids[i]);
      if (c < 0) throw nb::python_error();
      u.replace_block_ids = c == 1;
    }
    if (outputs) u.num_output_tokens = to_int32(outputs[i]);
    if (any_tokens) {
      PyObject* t = PyDict_GetItemWithError(all_token_ids.ptr(), ids[i]);
      if (!t && PyErr_Occurred()) throw nb::python_error();
      if (t) {
        s.update_token_bounds[2 * i] = s.tokens.size();
        read_int32s(t, s.tokens);
        s.update_token_bounds[2 * i + 1] = s.tokens.size();
      }
    }
  }
  const rt::Int32Span* spans = s.blocks.finish();
  s.update_tokens.resize(n);
  for (size_t i = 0; i < n; ++i) {
    if (s.update_block_list[i] >= 0) s.updates[i].new_block_ids = spans + s.update_block_list[i];
    if (s.update_token_bounds[2 * i] != SIZE_MAX) {
      const size_t b = s.update_token_bounds[2 * i], e = s.update_token_bounds[2 * i + 1];
      s.update_tokens[i] = rt::Int32Span(s.tokens.data() + b, e - b);
      s.updates[i].token_ids = &s.update_tokens[i];
    }
  }
  p.requests().update(s.updates.data(), n);
}

void pack(rt::BatchPacker& p, nb::handle num_scheduled_tokens, nb::handle spec_decode_tokens,
          int32_t pad_tokens_to) {
  if (!PyDict_Check(num_scheduled_tokens.ptr())) {
    throw nb::type_error("[BatchPacker] num_scheduled_tokens must be a dict {req_id: int}");
  }
  PyObject* spec = spec_decode_tokens.is_none() ? nullptr : spec_decode_tokens.ptr();
  if (spec && !PyDict_Check(spec)) {
    throw nb::type_error("[BatchPacker] spec_decode_tokens must be a dict {req_id: [int]}");
  }
  if (spec && PyDict_GET_SIZE(spec) == 0) spec = nullptr;
  Scratch& s = scratch();
  s.ids.clear();
  s.counts.clear();
  s.drafts.clear();
  s.draft_bounds.clear();
  Py_ssize_t pos = 0;
  PyObject *key = nullptr, *value = nullptr;
  while (PyDict_Next(num_scheduled_tokens.ptr(), &pos, &key, &value)) {
    s.ids.push_back(str_view(key));
    s.counts.push_back(to_int32(value));
    if (spec) {
      PyObject* d = PyDict_GetItemWithError(spec, key);
      if (!d && PyErr_Occurred()) throw nb::python_error();
      s.draft_bounds.push_back(s.drafts.size());
      if (d) read_int32s(d, s.drafts);
      s.draft_bounds.push_back(s.drafts.size());
    }
  }
  const rt::Int32Span* drafts = nullptr;
  if (spec) {
    s.draft_spans.resize(s.ids.size());
    for (size_t i = 0; i < s.ids.size(); ++i) {
      s.draft_spans[i] = rt::Int32Span(s.drafts.data() + s.draft_bounds[2 * i],
                                       s.draft_bounds[2 * i + 1] - s.draft_bounds[2 * i]);
    }
    drafts = s.draft_spans.data();
  }
  p.begin_step();
  p.schedule_many(s.ids.data(), s.counts.data(), drafts, s.ids.size());  // copies the drafts
  p.pack(pad_tokens_to);
}

void pack_rows(rt::BatchPacker& p, nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig> rows,
               nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig> num_tokens,
               int32_t pad_tokens_to) {
  if (rows.shape(0) != num_tokens.shape(0)) {
    throw nb::value_error("[BatchPacker] rows and num_tokens must have the same length");
  }
  p.begin_step();
  for (size_t i = 0; i < rows.shape(0); ++i) p.schedule_row(rows.data()[i], num_tokens.data()[i]);
  p.pack(pad_tokens_to);
}

void append_sampled(rt::BatchPacker& p, nb::handle token_ids) {
  nb::ndarray<const int32_t, nb::c_contig, nb::device::cpu> a;
  if (!nb::try_cast(token_ids, a, /*convert=*/true) || a.ndim() < 1 || a.ndim() > 2) {
    throw nb::type_error("[BatchPacker] token_ids must be an integer array [num_seqs] or [num_seqs, k]");
  }
  const int32_t rows = static_cast<int32_t>(a.shape(0));
  const int32_t stride = a.ndim() == 2 ? static_cast<int32_t>(a.shape(1)) : 1;
  p.append_sampled(a.data(), rows, stride);
}

int32_t row_of(const rt::BatchPacker& p, nb::handle req_id) {
  return p.requests().row_of(str_view(req_id));
}

template <typename T>
nb::ndarray<nb::numpy, T> owned_array(size_t n0, size_t n1, bool two_d, T** data) {
  *data = new T[n0 * n1 > 0 ? n0 * n1 : 1];
  nb::capsule owner(*data, [](void* q) noexcept { delete[] static_cast<T*>(q); });
  const size_t shape[2] = {n0, n1};
  return nb::ndarray<nb::numpy, T>(*data, two_d ? 2 : 1, shape, owner);
}

nb::tuple propose_ngram(rt::BatchPacker& p,
                        nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> rows,
                        int32_t min_n, int32_t max_n, int32_t k, int32_t max_model_len) {
  rt::check_ngram_params({min_n, max_n, k, max_model_len});  // before sizing [n, k]
  const size_t n = rows.shape(0);
  int32_t* drafts = nullptr;
  int32_t* num_drafts = nullptr;
  auto drafts_array = owned_array<int32_t>(n, static_cast<size_t>(k), true, &drafts);
  auto counts_array = owned_array<int32_t>(n, 1, false, &num_drafts);
  p.propose_ngram(rows.data(), static_cast<int32_t>(n), min_n, max_n, k, max_model_len, drafts,
                  num_drafts);
  return nb::make_tuple(drafts_array, counts_array);
}

std::vector<int32_t> ngram_propose(nb::handle tokens, int32_t min_n, int32_t max_n, int32_t k,
                                   int32_t max_model_len) {
  const rt::NgramParams params{min_n, max_n, k, max_model_len};
  rt::check_ngram_params(params);
  static thread_local std::vector<int32_t> failure;
  Scratch& s = scratch();
  s.tokens.clear();
  read_int32s(tokens, s.tokens);
  std::vector<int32_t> out(static_cast<size_t>(k));
  out.resize(static_cast<size_t>(rt::ngram_propose(rt::Int32Span(s.tokens), params, out.data(), failure)));
  return out;
}

}  // namespace

namespace vllm_metal::bindings {

void bind_runtime_packer(nb::module_& m) {
  nb::class_<rt::KvGroupSpec>(m, "KvGroupSpec", "One KV-cache group as the batch packer sees it.")
      .def(
          "__init__",
          [](rt::KvGroupSpec* self, int32_t block_size, int32_t kernel_block_size,
             int32_t max_blocks_per_req, int64_t num_blocks, bool paged) {
            new (self) rt::KvGroupSpec{block_size, kernel_block_size, max_blocks_per_req,
                                       num_blocks, paged};
          },
          "block_size"_a, nb::kw_only(), "kernel_block_size"_a = 0, "max_blocks_per_req"_a = 0,
          "num_blocks"_a = 0, "paged"_a = true,
          "block_size: vLLM's; kernel_block_size (0 = same) must divide it; max_blocks_per_req\n"
          "(0 = ceil(max_model_len / block_size)); num_blocks bounds block ids (0 = unchecked);\n"
          "paged=False for state groups (no slot mapping).")
      .def_rw("block_size", &rt::KvGroupSpec::block_size)
      .def_rw("kernel_block_size", &rt::KvGroupSpec::kernel_block_size)
      .def_rw("max_blocks_per_req", &rt::KvGroupSpec::max_blocks_per_req)
      .def_rw("num_blocks", &rt::KvGroupSpec::num_blocks)
      .def_rw("paged", &rt::KvGroupSpec::paged);

  m.def(
      "split_decode_prefill",
      [](nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig> query_lens,
         nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig> seq_lens, int32_t num_decode_like,
         int64_t min_total_context) {
        if (query_lens.shape(0) != seq_lens.shape(0) || num_decode_like < 0 ||
            static_cast<size_t>(num_decode_like) > seq_lens.shape(0)) {
          throw nb::value_error("[BatchPacker] expected query_lens and seq_lens of one length "
                                "and 0 <= num_decode_like <= that length");
        }
        auto s = rt::split_decode_prefill(query_lens.data(), seq_lens.data(), num_decode_like,
                                          static_cast<int32_t>(seq_lens.shape(0)),
                                          min_total_context);
        return nb::make_tuple(s.num_decodes, s.num_decode_tokens, s.num_prefills,
                              s.num_prefill_tokens);
      },
      "query_lens"_a, "seq_lens"_a, "num_decode_like"_a,
      "min_total_context"_a = rt::kDecodeMinTotalContext,
      "(num_decodes, num_decode_tokens, num_prefills, num_prefill_tokens): the leading\n"
      "num_decode_like rows go to the decode kernel once their seq_lens add up to\n"
      "min_total_context, else every row goes to the varlen kernel.");

  m.def("ngram_propose", &ngram_propose, "tokens"_a, "min_n"_a, "max_n"_a, "k"_a,
        "max_model_len"_a,
        "N-gram (prompt lookup) drafts for one token sequence, as BatchPacker.propose_ngram:\n"
        "the tokens after the earliest earlier occurrence of the longest tail n-gram\n"
        "(min_n <= n <= max_n), at most k and never past max_model_len; [] if none.");

  nb::class_<rt::BatchPacker>(
      m, "BatchPacker",
      "Persistent request table + per-step packing of scheduled requests into flat arrays\n"
      "(src/cpp/runtime/batch_packer.h). Output properties are read-only NumPy views of the\n"
      "packer's buffers, valid until the next pack().")
      .def(
          "__init__",
          [](rt::BatchPacker* self, int32_t max_num_reqs, int32_t max_num_batched_tokens,
             int32_t max_model_len, std::vector<rt::KvGroupSpec> kv_groups,
             int32_t mrope_num_dims, int64_t decode_min_total_context) {
            rt::BatchPackerConfig c;
            c.max_num_reqs = max_num_reqs;
            c.max_num_batched_tokens = max_num_batched_tokens;
            c.max_model_len = max_model_len;
            c.kv_groups = std::move(kv_groups);
            c.mrope_num_dims = mrope_num_dims;
            c.decode_min_total_context = decode_min_total_context;
            new (self) rt::BatchPacker(std::move(c));
          },
          nb::kw_only(), "max_num_reqs"_a, "max_num_batched_tokens"_a, "max_model_len"_a,
          "kv_groups"_a, "mrope_num_dims"_a = 0,
          "decode_min_total_context"_a = rt::kDecodeMinTotalContext)
      // ---- request table
      .def("add_request", &add_request, "req_id"_a, "token_ids"_a, nb::kw_only(),
           "num_computed_tokens"_a = 0, "block_ids"_a = nb::none(), "prompt_len"_a = -1,
           "mrope_positions"_a = nb::none(), "mrope_position_delta"_a = 0, "replace"_a = false,
           "Adds a request (token_ids: the prompt, or V2's prefill_token_ids; block_ids: one\n"
           "list per KV-cache group); returns its row. replace=True drops a request of that id.")
      .def("remove_requests", &remove_requests, "req_ids"_a,
           "Removes the requests; unknown ids are ignored. Returns how many were removed.")
      .def("update_requests", &update_requests, "req_ids"_a, "num_computed_tokens"_a,
           "new_block_ids"_a = nb::none(), nb::kw_only(), "resumed_req_ids"_a = nb::none(),
           "num_output_tokens"_a = nb::none(), "all_token_ids"_a = nb::none(),
           "Applies CachedRequestData: new block ids are appended, or replace the old for\n"
           "resumed ids; num_output_tokens drops outputs beyond it; all_token_ids replaces\n"
           "tokens. All or nothing.")
      .def(
          "append_tokens",
          [](rt::BatchPacker& p, nb::handle req_id, nb::handle token_ids) {
            Scratch& s = scratch();
            s.tokens.clear();
            read_int32s(token_ids, s.tokens);
            p.requests().append_tokens(str_view(req_id), rt::Int32Span(s.tokens));
          },
          "req_id"_a, "token_ids"_a)
      .def("append_sampled", &append_sampled, "token_ids"_a,
           "token_ids [num_seqs, k] (or [num_seqs]) in the last step's batch order, -1 ends a\n"
           "row; partial prefill chunks are skipped. Once per packed step.")
      .def("defer_sampled", &rt::BatchPacker::defer_sampled,
           "Async scheduling: instead of append_sampled, a placeholder token for each row of\n"
           "the last step that samples; resolve_deferred writes the real ones later.")
      .def(
          "resolve_deferred",
          [](rt::BatchPacker& p, nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> t) {
            p.resolve_deferred(t.data(), static_cast<int32_t>(t.shape(0)));
          },
          "token_ids"_a,
          "The oldest deferred step's sampled tokens [num_seqs] in its batch order, written\n"
          "over its placeholders (rows that left, were replaced, rolled back or resynced since\n"
          "are skipped).")
      .def_prop_ro("num_deferred_steps", &rt::BatchPacker::num_deferred_steps)
      .def("propose_ngram", &propose_ngram, "rows"_a, "min_n"_a, "max_n"_a, "k"_a,
           "max_model_len"_a,
           "N-gram (prompt lookup) drafts for table rows (int32 [n], live) from each row's\n"
           "tokens: (drafts int32 [n, k], num_drafts int32 [n]); row i's drafts are\n"
           "drafts[i, :num_drafts[i]], the rest -1. vLLM's NgramProposer rule: the longest\n"
           "tail n-gram (min_n <= n <= max_n) seen before, its earliest occurrence, at most\n"
           "k tokens and never past max_model_len.")
      .def("__contains__",
           [](const rt::BatchPacker& p, nb::handle id) {
             return PyUnicode_Check(id.ptr()) && p.requests().find(str_view(id)) >= 0;
           })
      .def("__len__", [](const rt::BatchPacker& p) { return p.requests().num_requests(); })
      .def("request_ids", [](const rt::BatchPacker& p) { return p.requests().request_ids(); })
      .def("row_of", [](const rt::BatchPacker& p, nb::handle id) {
        return p.requests().row_of(str_view(id));
      }, "req_id"_a)
      .def("token_ids", [](const rt::BatchPacker& p, nb::handle id) {
        return p.requests().row(row_of(p, id)).token_ids;
      }, "req_id"_a, "A copy of the request's tokens (prompt + output).")
      .def("block_ids", [](const rt::BatchPacker& p, nb::handle id) {
        return p.requests().block_id_lists(row_of(p, id));
      }, "req_id"_a, "Copies of the request's block ids, one list per KV-cache group.")
      .def("num_computed_tokens", [](const rt::BatchPacker& p, nb::handle id) {
        return p.requests().state(row_of(p, id)).num_computed_tokens;
      }, "req_id"_a)
      .def("prompt_len", [](const rt::BatchPacker& p, nb::handle id) {
        return p.requests().state(row_of(p, id)).prompt_len;
      }, "req_id"_a)
      // ---- one step
      .def("pack", &pack, "num_scheduled_tokens"_a, "spec_decode_tokens"_a = nb::none(),
           nb::kw_only(), "pad_tokens_to"_a = 0,
           "Packs a step: {req_id: num_tokens} (drafts included) and {req_id: [draft ids]}.\n"
           "Validates the whole step first: on error nothing changes.")
      .def("pack_rows", &pack_rows, "rows"_a, "num_tokens"_a, nb::kw_only(), "pad_tokens_to"_a = 0,
           "pack() by table rows (int32 arrays), without drafts.")
      // ---- outputs of the last step (read-only views)
      .def_prop_ro("input_ids", [](const rt::BatchPacker& p) {
        return view(p, p.input_ids(), {size_t(p.batch().num_tokens_padded)});
      }, "int32 [Tp]")
      .def_prop_ro("positions", [](const rt::BatchPacker& p) {
        const size_t t = size_t(p.batch().num_tokens_padded);
        return p.config().mrope_num_dims > 0
                   ? view(p, p.positions(), {size_t(p.config().mrope_num_dims), t})
                   : view(p, p.positions(), {t});
      }, "int32 [Tp], or [mrope_num_dims, Tp]")
      .def_prop_ro("slot_mapping", [](const rt::BatchPacker& p) {
        return view(p, p.slot_mapping(0), {size_t(p.batch().num_tokens_padded)});
      }, "int64 [Tp] of KV group 0")
      .def_prop_ro("slot_mappings", [](const rt::BatchPacker& p) {
        return view(p, p.slot_mapping(0),
                    {size_t(p.num_groups()), size_t(p.batch().num_tokens_padded)});
      }, "int64 [num_groups, Tp]")
      .def_prop_ro("block_table", [](const rt::BatchPacker& p) {
        return view(p, p.block_table(0),
                    {size_t(p.batch().num_seqs), size_t(p.block_table_width(0))});
      }, "int32 [num_seqs, width] of KV group 0, in kernel blocks")
      .def_prop_ro("block_tables", [](const rt::BatchPacker& p) {
        nb::list out;
        for (int32_t g = 0; g < p.num_groups(); ++g) {
          out.append(view(p, p.block_table(g),
                          {size_t(p.batch().num_seqs), size_t(p.block_table_width(g))}));
        }
        return nb::tuple(out);
      }, "tuple of int32 [num_seqs, width_g], one per KV group")
      .def_prop_ro("seq_lens", [](const rt::BatchPacker& p) {
        return view(p, p.seq_lens(), {size_t(p.batch().num_seqs)});
      })
      .def_prop_ro("cu_seqlens_q", [](const rt::BatchPacker& p) {
        return view(p, p.cu_seqlens_q(), {size_t(p.batch().num_seqs) + 1});
      })
      .def_prop_ro("logits_indices", [](const rt::BatchPacker& p) {
        return view(p, p.logits_indices(), {size_t(p.batch().num_logits)});
      })
      .def_prop_ro("cu_num_logits", [](const rt::BatchPacker& p) {
        return view(p, p.cu_num_logits(), {size_t(p.batch().num_seqs) + 1});
      })
      .def_prop_ro("req_rows", [](const rt::BatchPacker& p) {
        return view(p, p.req_rows(), {size_t(p.batch().num_seqs)});
      }, "int32 [num_seqs]: batch index -> request-table row")
      .def_prop_ro("discard_sampled", [](const rt::BatchPacker& p) {
        return view(p, reinterpret_cast<const bool*>(p.discard_sampled()),
                    {size_t(p.batch().num_seqs)});
      }, "bool [num_seqs]: partial prefill chunks, whose samples are dropped")
      .def_prop_ro("input_sources", [](const rt::BatchPacker& p) {
        return view(p, p.input_sources(),
                    {size_t(p.num_input_sources() > 0 ? p.batch().num_tokens : 0)});
      }, "int32 [T] when some input token is a deferred sample (else empty): -1, or the\n"
         "batch index in the newest deferred step of the sample that token is")
      .def_prop_ro("num_input_sources", [](const rt::BatchPacker& p) { return p.num_input_sources(); })
      .def_prop_ro("req_ids", [](const rt::BatchPacker& p) {
        nb::list out;
        for (int32_t b = 0; b < p.batch().num_seqs; ++b) {
          const std::string& id = p.requests().row(p.req_rows()[b]).req_id;
          out.append(nb::str(id.data(), id.size()));
        }
        return out;
      }, "request ids in batch order")
      .def_prop_ro("block_table_widths", [](const rt::BatchPacker& p) {
        std::vector<int32_t> w;
        for (int32_t g = 0; g < p.num_groups(); ++g) w.push_back(p.block_table_width(g));
        return w;
      })
      .def_prop_ro("block_table_used_widths", [](const rt::BatchPacker& p) {
        std::vector<int32_t> w;
        for (int32_t g = 0; g < p.num_groups(); ++g) w.push_back(p.block_table_used_width(g));
        return w;
      }, "columns of each block table that hold an id in some row (the rest is padding)")
      .def_prop_ro("num_seqs", [](const rt::BatchPacker& p) { return p.batch().num_seqs; })
      .def_prop_ro("num_tokens", [](const rt::BatchPacker& p) { return p.batch().num_tokens; })
      .def_prop_ro("num_tokens_padded",
                   [](const rt::BatchPacker& p) { return p.batch().num_tokens_padded; })
      .def_prop_ro("num_logits", [](const rt::BatchPacker& p) { return p.batch().num_logits; })
      .def_prop_ro("num_decode_like",
                   [](const rt::BatchPacker& p) { return p.batch().num_decode_like; })
      .def_prop_ro("decode_context",
                   [](const rt::BatchPacker& p) { return p.batch().decode_context; })
      .def_prop_ro("num_decodes", [](const rt::BatchPacker& p) { return p.batch().split.num_decodes; })
      .def_prop_ro("num_decode_tokens",
                   [](const rt::BatchPacker& p) { return p.batch().split.num_decode_tokens; })
      .def_prop_ro("num_prefills",
                   [](const rt::BatchPacker& p) { return p.batch().split.num_prefills; })
      .def_prop_ro("num_prefill_tokens",
                   [](const rt::BatchPacker& p) { return p.batch().split.num_prefill_tokens; })
      .def_prop_ro("max_query_len", [](const rt::BatchPacker& p) { return p.batch().max_query_len; })
      .def_prop_ro("max_seq_len", [](const rt::BatchPacker& p) { return p.batch().max_seq_len; })
      .def_prop_ro("num_kv_groups", [](const rt::BatchPacker& p) { return p.num_groups(); })
      .def_prop_ro("mrope_num_dims",
                   [](const rt::BatchPacker& p) { return p.config().mrope_num_dims; });
}

}  // namespace vllm_metal::bindings
