// Weight files: Hugging Face safetensors (the export slices of the descriptor table: row ranges
// of a parameter under HF names, transposed where HF keeps the other layout, GPT-2's Conv1D)
// and Strata's native layout (one tensor per parameter, storage layout). See model.hpp.
#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/bf16.hpp"
#include "strata/device.hpp"
#include "strata/log.hpp"
#include "strata/model.hpp"
#include "strata/safetensors.hpp"

namespace strata {
namespace {

constexpr const char* kNativeFormat = "strata";

// The HF shape of an export slice of `p`.
std::vector<std::int64_t> slice_shape(const ParamDesc& p, const ExportSlice& e) {
  if (p.shape.size() == 1) return {e.rows};
  const std::int64_t cols = p.numel() / p.shape[0];
  return e.transpose ? std::vector<std::int64_t>{cols, e.rows} : std::vector<std::int64_t>{e.rows, cols};
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string s = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + ")";
}

// Reads a tensor of the file as fp32 values.
Status read_f32(const SafetensorsFile& file, const SafetensorsEntry& entry, std::vector<char>& raw,
                std::vector<float>& out) {
  const std::uint64_t es = safetensors_dtype_size(entry.dtype);
  const std::uint64_t n = es == 0 ? 0 : entry.nbytes() / es;
  if (entry.dtype != "F32" && entry.dtype != "BF16" && entry.dtype != "F16") {
    return invalid_argument("weights file '" + file.path() + "': tensor '" + entry.name + "' has dtype " +
                            entry.dtype + " (expected F32, BF16 or F16)");
  }
  raw.resize(entry.nbytes());
  STRATA_RETURN_IF_ERROR(file.read(entry.name, raw.data(), raw.size()));
  out.resize(n);
  if (entry.dtype == "F32") {
    std::memcpy(out.data(), raw.data(), raw.size());
    return ok_status();
  }
  const bool bf = entry.dtype == "BF16";
  for (std::uint64_t k = 0; k < n; ++k) {
    std::uint16_t h;
    std::memcpy(&h, raw.data() + k * 2, 2);
    out[k] = bf ? kernels::bf16_bits_to_f32(h) : kernels::f16_bits_to_f32(h);
  }
  return ok_status();
}

bool is_native(const SafetensorsFile& file) {
  auto it = file.metadata().find("format");
  return it != file.metadata().end() && it->second == kNativeFormat;
}

// A tensor in an HF file: its exact name, or (GPT-2) with the "transformer." prefix that
// GPT2LMHeadModel state dicts carry.
const SafetensorsEntry* find_hf(const SafetensorsFile& file, const ModelLayout& layout,
                                const std::string& name) {
  if (const auto* e = file.find(name)) return e;
  if (layout.config.kind == ModelKind::kGpt2) return file.find("transformer." + name);
  return nullptr;
}

// Element `at` of `bytes` (a file's tensor bytes in `dtype`: f32, bf16 or f16) set to `v`.
void store_element(DType dtype, char* bytes, std::size_t at, float v) {
  if (dtype == DType::kF32) {
    std::memcpy(bytes + at * 4, &v, 4);
    return;
  }
  const std::uint16_t h = dtype == DType::kF16 ? kernels::f32_to_f16_bits_rne(v) : kernels::f32_to_bf16_bits_rne(v);
  std::memcpy(bytes + at * 2, &h, 2);
}

}  // namespace

Result<SafetensorsHeader> weights_header(const ModelLayout& layout, WeightFormat format, DType dtype) {
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16) {
    return invalid_argument("dtype " + std::string(to_string(dtype)) +
                            " cannot be written to a weights file (f32, bf16 or f16)");
  }
  const std::uint64_t esize = dtype == DType::kF32 ? 4 : 2;
  const char* st_dtype = dtype == DType::kBF16 ? "BF16" : (dtype == DType::kF16 ? "F16" : "F32");
  SafetensorsHeader header;
  // Tensors in table order, a parameter's export slices in their order: the order of the data.
  for (const ParamDesc& p : layout.params) {
    if (!p.owns_storage()) continue;
    if (format == WeightFormat::kNative) {
      STRATA_RETURN_IF_ERROR(
          header.add(p.name, st_dtype, p.shape, static_cast<std::uint64_t>(p.numel()) * esize));
      continue;
    }
    const std::int64_t cols = p.numel() / p.shape[0];
    for (const ExportSlice& e : p.exports) {
      STRATA_RETURN_IF_ERROR(
          header.add(e.name, st_dtype, slice_shape(p, e), static_cast<std::uint64_t>(e.rows * cols) * esize));
    }
  }
  ModelConfig stored = layout.config;
  stored.dtype = dtype;
  if (format == WeightFormat::kNative) {
    header.set_metadata("format", kNativeFormat);
    header.set_metadata("strata_model", model_config_to_json(stored));
  } else {
    header.set_metadata("format", "pt");  // transformers refuses files without it
  }
  header.set_metadata("config", hf_config_json(stored));
  header.set_metadata("producer", "strata");
  return header;
}

Status encode_weights(const ModelLayout& layout, int index, WeightFormat format, DType dtype,
                      std::span<const float> values, std::vector<EncodedTensor>& out) {
  out.clear();
  if (index < 0 || static_cast<std::size_t>(index) >= layout.params.size() ||
      !layout.params[static_cast<std::size_t>(index)].owns_storage()) {
    return invalid_argument("encode_weights: no owning parameter with index " + std::to_string(index));
  }
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16) {
    return invalid_argument("encode_weights: dtype " + std::string(to_string(dtype)) +
                            " cannot be written (f32, bf16 or f16)");
  }
  const ParamDesc& p = layout.params[static_cast<std::size_t>(index)];
  if (values.size() != static_cast<std::size_t>(p.numel())) {
    return internal_error("write_weights: parameter '" + p.name + "' came back with the wrong size");
  }
  const std::uint64_t esize = dtype == DType::kF32 ? 4 : 2;
  auto store = [&](std::vector<char>& bytes, std::size_t at, float v) { store_element(dtype, bytes.data(), at, v); };
  if (format == WeightFormat::kNative) {
    EncodedTensor& t = out.emplace_back();
    t.name = p.name;
    t.bytes.resize(values.size() * esize);
    for (std::size_t k = 0; k < values.size(); ++k) store(t.bytes, k, values[k]);
    return ok_status();
  }
  const std::int64_t cols = p.numel() / p.shape[0];
  for (const ExportSlice& e : p.exports) {
    EncodedTensor& t = out.emplace_back();
    t.name = e.name;
    t.bytes.resize(static_cast<std::size_t>(e.rows * cols) * esize);
    const float* src = values.data() + e.row_begin * cols;
    for (std::int64_t r = 0; r < e.rows; ++r) {
      for (std::int64_t c = 0; c < cols; ++c) {
        // (rows, cols) as stored, or transposed to (cols, rows).
        const std::int64_t at = e.transpose ? c * e.rows + r : r * cols + c;
        store(t.bytes, static_cast<std::size_t>(at), src[r * cols + c]);
      }
    }
  }
  return ok_status();
}

Status encode_weights_part(const ModelLayout& layout, const SafetensorsHeader& header, int index,
                           WeightFormat format, DType dtype, std::span<const ElementRun> runs,
                           std::span<const float> values, std::vector<EncodedRange>& out) {
  out.clear();
  if (index < 0 || static_cast<std::size_t>(index) >= layout.params.size() ||
      !layout.params[static_cast<std::size_t>(index)].owns_storage()) {
    return invalid_argument("encode_weights_part: no owning parameter with index " + std::to_string(index));
  }
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16) {
    return invalid_argument("encode_weights_part: dtype " + std::string(to_string(dtype)) +
                            " cannot be written (f32, bf16 or f16)");
  }
  const ParamDesc& p = layout.params[static_cast<std::size_t>(index)];
  const std::int64_t numel = p.numel(), cols = numel / p.shape[0];
  const std::uint64_t esize = dtype == DType::kF32 ? 4 : 2;
  // The parameter's tensors in the file: its export slices (HF) or itself (native).
  struct Target {
    const SafetensorsEntry* entry;
    std::int64_t row_begin, rows;
    bool transpose;
  };
  std::vector<Target> targets;
  if (format == WeightFormat::kNative) {
    targets.push_back({header.find(p.name), 0, p.shape[0], false});
  } else {
    for (const ExportSlice& e : p.exports) targets.push_back({header.find(e.name), e.row_begin, e.rows, e.transpose});
  }
  for (const Target& t : targets) {
    if (t.entry == nullptr || t.entry->nbytes() != static_cast<std::uint64_t>(t.rows * cols) * esize) {
      return invalid_argument("encode_weights_part: the header does not hold parameter '" + p.name +
                              "' in this format and dtype");
    }
  }
  // The runs cut into row segments, per tensor: (row in the tensor, columns [c0, c1), the index
  // of element (row, c0) in `values`).
  struct Segment {
    std::int64_t row, c0, c1;
    std::size_t value;
  };
  std::vector<std::vector<Segment>> segments(targets.size());
  std::size_t v = 0;
  for (const ElementRun& run : runs) {
    if (run.count < 0 || run.full_begin < 0 || run.full_begin + run.count > numel) {
      return invalid_argument("encode_weights_part: elements [" + std::to_string(run.full_begin) + ", " +
                              std::to_string(run.full_begin + run.count) + ") are outside parameter '" + p.name +
                              "' (" + std::to_string(numel) + " elements)");
    }
    for (std::int64_t j = run.full_begin; j < run.full_begin + run.count;) {
      const std::int64_t r = j / cols, c0 = j % cols, c1 = std::min(cols, c0 + run.full_begin + run.count - j);
      for (std::size_t k = 0; k < targets.size(); ++k) {
        const Target& t = targets[k];
        if (r < t.row_begin || r >= t.row_begin + t.rows) continue;  // else: vocabulary padding
        segments[k].push_back({r - t.row_begin, c0, c1, v + static_cast<std::size_t>(j - run.full_begin)});
        break;
      }
      j += c1 - c0;
    }
    v += static_cast<std::size_t>(run.count);
  }
  if (v != values.size()) {
    return invalid_argument("encode_weights_part: parameter '" + p.name + "': " + std::to_string(values.size()) +
                            " values for runs of " + std::to_string(v) + " elements");
  }
  // Elements in file order (the targets are in file order), appended to the open range while
  // they are adjacent to it in the same tensor.
  std::size_t open = targets.size();  // the target of out.back()
  auto emit = [&](std::size_t k, std::uint64_t at, std::size_t value, std::uint64_t count) {
    if (open != k || out.back().offset + out.back().bytes.size() != at) {
      EncodedRange& range = out.emplace_back();
      range.tensor = targets[k].entry->name;
      range.offset = at;
      open = k;
    }
    std::vector<char>& bytes = out.back().bytes;
    const std::size_t first = bytes.size() / esize;
    bytes.resize(bytes.size() + count * esize);
    for (std::uint64_t e = 0; e < count; ++e) store_element(dtype, bytes.data(), first + e, values[value + e]);
  };
  for (std::size_t k = 0; k < targets.size(); ++k) {
    const Target& t = targets[k];
    std::vector<Segment>& segs = segments[k];
    if (segs.empty()) continue;
    std::sort(segs.begin(), segs.end(),
              [](const Segment& a, const Segment& b) { return a.row != b.row ? a.row < b.row : a.c0 < b.c0; });
    if (!t.transpose) {  // (rows, cols): a segment is contiguous in the file
      for (const Segment& g : segs) {
        emit(k, t.entry->data_begin + static_cast<std::uint64_t>(g.row * cols + g.c0) * esize, g.value,
             static_cast<std::uint64_t>(g.c1 - g.c0));
      }
      continue;
    }
    // (cols, rows) in the file: column by column, each segment's element of that column in row order.
    std::int64_t lo = cols, hi = 0;
    for (const Segment& g : segs) {
      lo = std::min(lo, g.c0);
      hi = std::max(hi, g.c1);
    }
    for (std::int64_t c = lo; c < hi; ++c) {
      for (const Segment& g : segs) {
        if (c < g.c0 || c >= g.c1) continue;
        emit(k, t.entry->data_begin + static_cast<std::uint64_t>(c * t.rows + g.row) * esize,
             g.value + static_cast<std::size_t>(c - g.c0), 1);
      }
    }
  }
  return ok_status();
}

Status write_weights(const ModelLayout& layout, const std::string& path, WeightFormat format, DType dtype,
                     const ParamSource& source) {
  auto header = weights_header(layout, format, dtype);
  if (!header.ok()) return header.status().with_context("write_weights '" + path + "'");
  // One parameter's values and bytes at a time, written at their offsets: the same file as the
  // writers of a pipeline's stages fill together.
  Status s = SafetensorsPartWriter::create(path, *header);
  if (!s.ok()) return s.with_context("saving weights to '" + path + "'");
  auto part = SafetensorsPartWriter::open(path, *header);
  s = part.status();
  std::vector<float> values;
  std::vector<EncodedTensor> tensors;
  for (std::size_t i = 0; s.ok() && i < layout.params.size(); ++i) {
    const ParamDesc& p = layout.params[i];
    if (!p.owns_storage()) continue;
    values.assign(static_cast<std::size_t>(p.numel()), 0.0f);
    s = source(static_cast<int>(i), values);
    if (!s.ok()) break;  // the source's own error, as it said it
    s = encode_weights(layout, static_cast<int>(i), format, dtype, values, tensors);
    for (std::size_t k = 0; s.ok() && k < tensors.size(); ++k) {
      s = part->write(tensors[k].name, tensors[k].bytes.data(), tensors[k].bytes.size());
      if (!s.ok()) s = s.with_context("saving weights to '" + path + "'");
    }
  }
  if (part.ok()) {
    Status closed = part->close();
    if (s.ok() && !closed.ok()) s = closed.with_context("saving weights to '" + path + "'");
  }
  if (s.ok()) {
    s = SafetensorsPartWriter::publish(path);
    if (!s.ok()) s = s.with_context("saving weights to '" + path + "'");
  }
  if (!s.ok()) SafetensorsPartWriter::discard(path);
  return s;
}

Status save_weights(Model& model, const std::string& path, WeightFormat format) {
  return write_weights(model.layout(), path, format, model.config().dtype,
                       [&](int index, std::vector<float>& values) -> Status {
                         STRATA_ASSIGN_OR_RETURN(values, model.download_param(index));
                         return ok_status();
                       });
}

Result<ModelConfig> read_weights_config(const std::string& path) {
  STRATA_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::open(path));
  const auto& meta = file.metadata();
  if (is_native(file)) {
    auto it = meta.find("strata_model");
    if (it == meta.end())
      return invalid_argument("weights file '" + path + "' has format strata but no strata_model");
    return model_config_from_json(it->second, "weights file '" + path + "': __metadata__.strata_model");
  }
  auto it = meta.find("config");
  if (it == meta.end()) {
    return invalid_argument("weights file '" + path +
                            "' has no model config (a JSON string under \"config\" in __metadata__)");
  }
  return model_config_from_hf_json(it->second, "weights file '" + path + "': __metadata__.config");
}

Status read_weights(const ModelLayout& layout, const std::string& path, const ParamSink& sink) {
  STRATA_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::open(path));
  const bool native = is_native(file);
  std::vector<float> values, slice;
  std::vector<char> raw;
  for (std::size_t i = 0; i < layout.params.size(); ++i) {
    const ParamDesc& p = layout.params[i];
    if (!p.owns_storage()) continue;
    const std::int64_t cols = p.numel() / p.shape[0];
    if (native) {
      const SafetensorsEntry* entry = file.find(p.name);
      if (entry == nullptr) return not_found("weights file '" + path + "' has no tensor '" + p.name + "'");
      if (entry->shape != p.shape) {
        return invalid_argument("weights file '" + path + "': tensor '" + p.name + "' has shape " +
                                shape_text(entry->shape) + ", the model config needs " + shape_text(p.shape));
      }
      STRATA_RETURN_IF_ERROR(read_f32(file, *entry, raw, values));
      STRATA_RETURN_IF_ERROR(sink(static_cast<int>(i), values));
      continue;
    }
    values.assign(static_cast<std::size_t>(p.numel()), 0.0f);  // padded vocabulary rows stay zero
    for (const ExportSlice& e : p.exports) {
      const SafetensorsEntry* entry = find_hf(file, layout, e.name);
      if (entry == nullptr) return not_found("weights file '" + path + "' has no tensor '" + e.name + "'");
      const std::vector<std::int64_t> want = slice_shape(p, e);
      if (entry->shape != want) {
        return invalid_argument("weights file '" + path + "': tensor '" + entry->name + "' has shape " +
                                shape_text(entry->shape) + ", the model config needs " + shape_text(want));
      }
      STRATA_RETURN_IF_ERROR(read_f32(file, *entry, raw, slice));
      float* dst = values.data() + e.row_begin * cols;
      for (std::int64_t r = 0; r < e.rows; ++r) {
        for (std::int64_t c = 0; c < cols; ++c) {
          dst[r * cols + c] = slice[static_cast<std::size_t>(e.transpose ? c * e.rows + r : r * cols + c)];
        }
      }
    }
    STRATA_RETURN_IF_ERROR(sink(static_cast<int>(i), values));
  }
  return ok_status();
}

Status load_weights(Model& model, const std::string& path) {
  STRATA_RETURN_IF_ERROR(read_weights(model.layout(), path, [&](int index, std::span<const float> values) {
    return model.upload_param(index, values);
  }));
  return model.stream().synchronize();
}

}  // namespace strata
