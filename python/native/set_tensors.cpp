// set_tensors.cpp - tshare._torch_native: the torch tensors of a received
// set, made in C++ against the torch the interpreter runs.
//
// A received set's tensors are made from what _tshare's recv lays out (one
// DLPack capsule per memory, each member a place in one; py_set_recv.c). The
// pure Python path makes them with torch's Python API: from_dlpack per
// memory, narrow and view per dtype, as_strided per member. Each such call
// costs 2 to 3 us on a recent torch (argument parsing, the dispatcher, view
// tracking), so a 290-tensor state_dict spends over a millisecond in torch
// alone. Here each tensor is a TensorImpl over its memory's storage, made
// directly: the same storages, the same deleters, the same tensors, at a
// tenth of the cost.
//
// Built only against the torch whose Python package the build's interpreter
// imports (python/CMakeLists.txt); tshare/_sets.py uses it when it loads and
// its torch version is the running one, and falls back to Python otherwise.
#include <Python.h>

#include <ATen/ATen.h>
#include <c10/core/TensorImpl.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/version.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

namespace dl {
#include "../src/dlpack_abi.h"
}  // namespace dl

namespace {

constexpr int kDeviceCuda = 2;  // DLPack's kDLCUDA

// What a capsule holds, whichever DLPack version made it.
struct Capsule {
  void *managed = nullptr;
  dl::DLTensor *tensor = nullptr;
  bool versioned = false;
};

bool open_capsule(PyObject *capsule, Capsule *out) {
  const char *name = PyCapsule_GetName(capsule);
  if (!name) return false;
  out->versioned = std::strcmp(name, DLPACK_CAPSULE_VERSIONED) == 0;
  if (!out->versioned && std::strcmp(name, DLPACK_CAPSULE) != 0) {
    PyErr_Format(PyExc_ValueError, "tshare: set_tensors: capsule %s was used already", name);
    return false;
  }
  out->managed = PyCapsule_GetPointer(capsule, name);
  if (!out->managed) return false;
  out->tensor = out->versioned ? &static_cast<dl::DLManagedTensorVersioned *>(out->managed)->dl_tensor
                               : &static_cast<dl::DLManagedTensor *>(out->managed)->dl_tensor;
  return true;
}

void release_classic(void *managed) {
  auto *m = static_cast<dl::DLManagedTensor *>(managed);
  if (m->deleter) m->deleter(m);
}

void release_versioned(void *managed) {
  auto *m = static_cast<dl::DLManagedTensorVersioned *>(managed);
  if (m->deleter) m->deleter(m);
}

// The tensor over a capsule's memory, as torch.from_dlpack makes it (its
// storage's deleter is the capsule's), in dtype.
at::Tensor consume_capsule(PyObject *capsule, const Capsule &c, at::ScalarType dtype) {
  const dl::DLTensor *t = c.tensor;
  c10::Device device = t->device.device_type == kDeviceCuda
                         ? c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(t->device.device_id))
                         : c10::Device(c10::kCPU);
  at::IntArrayRef sizes(t->shape, static_cast<size_t>(t->ndim));
  at::Tensor out = at::for_blob(static_cast<char *>(t->data) + t->byte_offset, sizes)
                     .strides(t->strides ? at::OptionalIntArrayRef(at::IntArrayRef(t->strides, static_cast<size_t>(t->ndim)))
                                         : at::OptionalIntArrayRef())
                     .context(c.managed, c.versioned ? release_versioned : release_classic)
                     .target_device(device)
                     .options(at::TensorOptions().dtype(dtype).device(device))
                     .make_tensor();
  // Used from here, as torch marks it once its tensor is made: the tensor
  // owns the context and calls its deleter once, on the storage's end; the
  // capsule's destructor must not call it again. A maker that throws first
  // (a size check) leaves the capsule to release the memory.
  PyCapsule_SetName(capsule, c.versioned ? DLPACK_CAPSULE_VERSIONED_USED : DLPACK_CAPSULE_USED);
  return out;
}

// A tensor on base's storage: dtype, sizes, strides and an offset in
// elements of dtype. No dispatcher call, no view record (its _base is None):
// what as_strided would make of a base that needs no gradient, without its
// cost. The place
// was checked against its memory by the core; it is checked against the
// storage here again, since a wrong one would read outside it.
bool member_of(const at::Tensor &base, at::ScalarType dtype, at::IntArrayRef sizes, at::IntArrayRef strides,
               int64_t offset, at::Tensor *out) {
  const int64_t item = static_cast<int64_t>(c10::elementSize(dtype));
  if (offset < 0) return false;
  int64_t last = offset;  // the highest element's index
  bool empty = false;
  for (size_t d = 0; d < sizes.size(); d++) {
    if (sizes[d] < 0 || strides[d] < 0) return false;
    int64_t span;
    if (sizes[d] == 0) empty = true;
    else if (__builtin_mul_overflow(sizes[d] - 1, strides[d], &span) || __builtin_add_overflow(last, span, &last))
      return false;
  }
  int64_t end;
  const int64_t storage_bytes = static_cast<int64_t>(base.storage().nbytes());
  if (!empty && (__builtin_mul_overflow(last + 1, item, &end) || end > storage_bytes)) return false;
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(base.storage()), base.key_set(),
                                                   caffe2::TypeMeta::fromScalarType(dtype));
  // One version counter with its memory's tensor, as a view of it has: an
  // in-place write through one member is seen by autograd on the others.
  impl->set_version_counter(base.unsafeGetTensorImpl()->version_counter());
  impl->set_storage_offset(offset);
  impl->set_sizes_and_strides(sizes, strides);
  *out = at::Tensor(std::move(impl));
  return true;
}

bool int64s(PyObject *seq, std::vector<int64_t> *out) {
  if (!PyTuple_Check(seq)) {
    PyErr_SetString(PyExc_TypeError, "tshare: set_tensors: a shape or strides is not a tuple");
    return false;
  }
  out->resize(static_cast<size_t>(PyTuple_GET_SIZE(seq)));
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(seq); k++) {
    (*out)[static_cast<size_t>(k)] = PyLong_AsLongLong(PyTuple_GET_ITEM(seq, k));
    if ((*out)[static_cast<size_t>(k)] == -1 && PyErr_Occurred()) return false;
  }
  return true;
}

// The scalar type of dtypes[(code, bits)]; false with a Python error.
bool scalar_type(PyObject *dtypes, PyObject *code, PyObject *bits, at::ScalarType *out) {
  PyObject *key = PyTuple_Pack(2, code, bits);
  PyObject *dtype = key ? PyDict_GetItemWithError(dtypes, key) : nullptr;
  Py_XDECREF(key);
  if (!dtype || !THPDtype_Check(dtype)) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "tshare: set_tensors: a dtype torch does not have");
    return false;
  }
  *out = reinterpret_cast<THPDtype *>(dtype)->scalar_type;
  return true;
}

PyObject *wrap(const at::Tensor &t) { return THPVariable_Wrap(t); }

// A layout entry of kinds or own: a 5-tuple with an index first and (code,
// bits) at code_at; false with a Python error.
bool layout_entry(PyObject *e, const char *what, Py_ssize_t code_at, PyObject *dtypes, Py_ssize_t *index,
                  at::ScalarType *dtype) {
  if (!PyTuple_Check(e) || PyTuple_GET_SIZE(e) != 5) {
    PyErr_Format(PyExc_TypeError, "tshare: set_tensors: a bad %s", what);
    return false;
  }
  *index = PyLong_AsSsize_t(PyTuple_GET_ITEM(e, 0));
  if (PyErr_Occurred()) return false;
  return scalar_type(dtypes, PyTuple_GET_ITEM(e, code_at), PyTuple_GET_ITEM(e, code_at + 1), dtype);
}

// set_tensors(bases, kinds, views, own, dtypes) -> (memories, keys, tensors, cuda)
//   bases: [capsule] one per memory; kinds: [(memory, code, bits, usable
//   bytes, name)]; views: [(name, kind, shape, strides, element offset)] in
//   the sender's order; own: [(index, name, capsule, code, bits)]; dtypes:
//   {(code, bits): torch.dtype}. memories: a tensor per capsule, bases first,
//   then own's (what holds each capsule's memory until the caller bound its
//   key); keys: each consumed capsule's storage key (its StorageImpl);
//   tensors: {name: tensor} in the sender's order; cuda: the device index of
//   the first CUDA memory, or -1.
PyObject *set_tensors(PyObject *, PyObject *args) {
  PyObject *bases, *kinds, *views, *own, *dtypes;
  PyObject *memories = nullptr, *keys = nullptr, *tensors = nullptr, *result = nullptr;
  if (!PyArg_ParseTuple(args, "O!O!O!O!O!", &PyList_Type, &bases, &PyList_Type, &kinds, &PyList_Type, &views,
                        &PyList_Type, &own, &PyDict_Type, &dtypes))
    return nullptr;
  try {
    const Py_ssize_t n_bases = PyList_GET_SIZE(bases), n_kinds = PyList_GET_SIZE(kinds);
    const Py_ssize_t n_views = PyList_GET_SIZE(views), n_own = PyList_GET_SIZE(own), n_caps = n_bases + n_own;
    // Every capsule (bases', then own's) and dtype is looked at before one
    // is consumed: a refusal leaves them all to their owner.
    std::vector<PyObject *> capsule(static_cast<size_t>(n_caps));
    std::vector<Capsule> opened(static_cast<size_t>(n_caps));
    std::vector<at::ScalarType> dtype(static_cast<size_t>(n_caps), at::kByte);  // bases are bytes
    std::vector<Py_ssize_t> own_index(static_cast<size_t>(n_own));
    for (Py_ssize_t o = 0; o < n_own; o++) {
      PyObject *e = PyList_GET_ITEM(own, o);
      if (!layout_entry(e, "member", 3, dtypes, &own_index[static_cast<size_t>(o)],
                        &dtype[static_cast<size_t>(n_bases + o)]))
        return nullptr;
      capsule[static_cast<size_t>(n_bases + o)] = PyTuple_GET_ITEM(e, 2);
    }
    for (Py_ssize_t b = 0; b < n_bases; b++) capsule[static_cast<size_t>(b)] = PyList_GET_ITEM(bases, b);
    long cuda = -1;
    for (size_t j = 0; j < capsule.size(); j++) {
      if (!open_capsule(capsule[j], &opened[j])) return nullptr;
      if (cuda < 0 && opened[j].tensor->device.device_type == kDeviceCuda) cuda = opened[j].tensor->device.device_id;
    }
    std::vector<at::ScalarType> kind_dtype(static_cast<size_t>(n_kinds));
    std::vector<Py_ssize_t> kind_memory(static_cast<size_t>(n_kinds));
    for (size_t k = 0; k < kind_dtype.size(); k++) {
      if (!layout_entry(PyList_GET_ITEM(kinds, static_cast<Py_ssize_t>(k)), "kind", 1, dtypes, &kind_memory[k],
                        &kind_dtype[k]))
        return nullptr;
      if (kind_memory[k] < 0 || kind_memory[k] >= n_bases)
        return PyErr_SetString(PyExc_IndexError, "tshare: set_tensors: a kind of no memory"), nullptr;
    }

    memories = PyList_New(n_caps), keys = PyList_New(n_caps), tensors = PyDict_New();
    std::vector<at::Tensor> consumed(static_cast<size_t>(n_caps));
    bool ok = memories && keys && tensors;
    // Consumed from here: each capsule's memory is its tensor's from now on.
    for (size_t j = 0; ok && j < capsule.size(); j++) {
      consumed[j] = consume_capsule(capsule[j], opened[j], dtype[j]);
      PyObject *t = wrap(consumed[j]);
      PyObject *key = PyLong_FromVoidPtr(consumed[j].storage().unsafeGetStorageImpl());
      ok = t && key;
      if (t) PyList_SET_ITEM(memories, static_cast<Py_ssize_t>(j), t);
      if (key) PyList_SET_ITEM(keys, static_cast<Py_ssize_t>(j), key);
    }
    // The members in the sender's order: own's at their indexes, views in
    // between, in their order.
    std::vector<int64_t> sizes, strides;
    Py_ssize_t next_view = 0, next_own = 0;
    for (Py_ssize_t i = 0; ok && i < n_views + n_own; i++) {
      PyObject *name;
      at::Tensor member;
      if (next_own < n_own && own_index[static_cast<size_t>(next_own)] == i) {
        name = PyTuple_GET_ITEM(PyList_GET_ITEM(own, next_own), 1);
        member = consumed[static_cast<size_t>(n_bases + next_own++)];
      } else if (next_view < n_views) {
        Py_ssize_t kind;
        PyObject *shape, *stride_tuple;
        long long offset;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(views, next_view++), "OnOOL", &name, &kind, &shape, &stride_tuple,
                              &offset))
          break;
        if (kind < 0 || kind >= n_kinds || !int64s(shape, &sizes) || !int64s(stride_tuple, &strides) ||
            sizes.size() != strides.size()) {
          if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "tshare: set_tensors: member %zd has a bad place", i);
          break;
        }
        const size_t k = static_cast<size_t>(kind);
        if (!member_of(consumed[static_cast<size_t>(kind_memory[k])], kind_dtype[k], sizes, strides, offset,
                       &member)) {
          PyErr_Format(PyExc_ValueError, "tshare: set_tensors: member %zd lies outside its memory", i);
          break;
        }
      } else {
        PyErr_SetString(PyExc_ValueError, "tshare: set_tensors: a member's index is out of order");
        break;
      }
      PyObject *t = wrap(member);
      ok = t && PyDict_SetItem(tensors, name, t) == 0;
      Py_XDECREF(t);
    }
    if (ok && !PyErr_Occurred()) result = Py_BuildValue("(OOOl)", memories, keys, tensors, cuda);
  } catch (const std::exception &e) {
    PyErr_Format(PyExc_RuntimeError, "tshare: set_tensors: %s", e.what());
  }
  Py_XDECREF(memories);
  Py_XDECREF(keys);
  Py_XDECREF(tensors);
  return result;
}

// ---- what a send reads of each member -----------------------------------------

PyObject *int_tuple(at::IntArrayRef values) {
  PyObject *t = PyTuple_New(static_cast<Py_ssize_t>(values.size()));
  for (size_t k = 0; t && k < values.size(); k++) {
    PyObject *v = PyLong_FromLongLong(values[k]);
    if (!v) {
      Py_CLEAR(t);
      break;
    }
    PyTuple_SET_ITEM(t, static_cast<Py_ssize_t>(k), v);
  }
  return t;
}

// A member of pairs as a send reads it: its name and its tensor, a plain
// one (of plain_types: exact types whose methods are torch's own, Tensor and
// Parameter) with storage; false, with no error set, for anything else,
// which the Python methods then read.
struct Member {
  PyObject *name;
  const at::Tensor *tensor;
  bool lazy;  // a lazily negated or conjugated view
};

bool plain_member(PyObject *pair, PyObject *plain_types, Member *out) {
  if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) return false;
  PyObject *obj = PyTuple_GET_ITEM(pair, 1);
  if (PySequence_Contains(plain_types, reinterpret_cast<PyObject *>(Py_TYPE(obj))) != 1) {
    PyErr_Clear();
    return false;
  }
  const at::Tensor &t = THPVariable_Unpack(obj);
  if (!t.defined() || !t.has_storage()) return false;
  *out = {PyTuple_GET_ITEM(pair, 0), &t, t.is_neg() || (t.is_complex() && t.is_conj())};
  return true;
}

// (name, data_ptr, dtype, shape, strides, lazy) of m, as _tshare._set_items
// reads it through torch's Python methods.
PyObject *member_item(const Member &m) {
  const at::Tensor &t = *m.tensor;
  // Every read that may throw before a Python object exists.
  void *address = t.data_ptr();
  const at::ScalarType dtype = t.scalar_type();
  const at::IntArrayRef size_values = t.sizes(), stride_values = t.strides();
  PyObject *data = PyLong_FromVoidPtr(address);
  PyObject *shape = int_tuple(size_values), *strides = int_tuple(stride_values);
  PyObject *item = nullptr;
  if (data && shape && strides)
    item = PyTuple_Pack(6, m.name, data, reinterpret_cast<PyObject *>(torch::getTHPDtype(dtype)), shape, strides,
                        m.lazy ? Py_True : Py_False);
  Py_XDECREF(data);
  Py_XDECREF(shape);
  Py_XDECREF(strides);
  return item;
}

// What holds a CUDA member's memory while a set names it: its storage, not
// the tensor, since a tensor may be pointed at other memory later (set_,
// .data =, share_model_(pack_cuda=True)) while a sent set or a kept segment
// still names the old one. A capsule of a c10::Storage: cheaper than torch's
// Python storage object, dropped with the GIL like any object.
constexpr const char *kStorageHold = "tshare.storage_hold";

void drop_storage_hold(PyObject *capsule) {
  delete static_cast<c10::Storage *>(PyCapsule_GetPointer(capsule, kStorageHold));
}

PyObject *storage_hold(const c10::Storage &storage) {
  auto *held = new c10::Storage(storage);
  PyObject *capsule = PyCapsule_New(held, kStorageHold, drop_storage_hold);
  if (!capsule) delete held;
  return capsule;
}

// item with a CUDA member's fields after it: (storage_key, storage_base,
// holder, device), what tshare/_sets.py's _with_cuda adds through torch's
// Python methods (untyped_storage()._cdata and .data_ptr(), the storage
// object, device.index); the holder here is storage_hold's. Steals item.
PyObject *with_cuda_fields(PyObject *item, const at::Tensor &t) {
  const c10::Storage &storage = t.storage();
  PyObject *holder = storage_hold(storage);
  PyObject *cuda = holder ? Py_BuildValue("(KKNi)", static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(
                                                         storage.unsafeGetStorageImpl())),
                                          static_cast<unsigned long long>(
                                              reinterpret_cast<uintptr_t>(storage.data_ptr().get())),
                                          holder, static_cast<int>(t.device().index()))
                          : nullptr;
  PyObject *out = cuda ? PyTuple_New(PyTuple_GET_SIZE(item) + 1) : nullptr;
  for (Py_ssize_t k = 0; out && k < PyTuple_GET_SIZE(item); k++) {
    PyObject *field = PyTuple_GET_ITEM(item, k);
    Py_INCREF(field);
    PyTuple_SET_ITEM(out, k, field);
  }
  if (out) PyTuple_SET_ITEM(out, PyTuple_GET_SIZE(item), cuda);
  else Py_XDECREF(cuda);
  Py_DECREF(item);
  return out;
}

// The items of pairs (each (name, data_ptr, dtype, shape, strides, lazy)),
// with each CUDA member's fields after its own when cuda (and *device the
// first CUDA member's, else -1); None, with no error set, when a member is
// not plain (plain_member).
PyObject *items_of(PyObject *args, bool cuda, long *device) {
  PyObject *pairs, *plain_types;
  if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &pairs, &PyTuple_Type, &plain_types)) return nullptr;
  const Py_ssize_t n = PyList_GET_SIZE(pairs);
  PyObject *out = PyList_New(n);
  *device = -1;
  try {
    Member m;
    for (Py_ssize_t i = 0; out && i < n; i++) {
      PyObject *pair = PyList_GET_ITEM(pairs, i);
      PyObject *item = plain_member(pair, plain_types, &m) ? member_item(m) : nullptr;
      if (item && cuda && m.tensor->is_cuda()) {
        item = with_cuda_fields(item, *m.tensor);
        if (*device < 0) *device = m.tensor->device().index();
      }
      if (!item) Py_CLEAR(out);
      else PyList_SET_ITEM(out, i, item);
    }
  } catch (const std::exception &) {
    Py_CLEAR(out);
  }
  if (out) return out;
  PyErr_Clear();  // the Python methods read it again, and raise what they raise
  Py_RETURN_NONE;
}

// set_items(pairs, plain_types) -> [(name, data_ptr, dtype, shape, strides,
// lazy)] for pairs, a list of (name, tensor), or None when a member is not
// plain (plain_member).
PyObject *set_items(PyObject *, PyObject *args) {
  long device;
  return items_of(args, false, &device);
}

// set_items_cuda(pairs, plain_types) -> (items, cuda_device): set_items'
// items, each CUDA member's with its CUDA fields (with_cuda_fields), and the
// device of the first CUDA member (-1: none), so that a set with CUDA
// members is built in one pass (a 290-tensor model's _with_cuda took a
// millisecond); None as set_items.
PyObject *set_items_cuda(PyObject *, PyObject *args) {
  long device;
  PyObject *items = items_of(args, true, &device);
  if (!items || items == Py_None) return items;
  return Py_BuildValue("(Nl)", items, device);
}

template <typename T>
char *put(char *at, T value) {
  std::memcpy(at, &value, sizeof value);
  return at + sizeof value;
}

// One member's part of a set key, appended to key: false (no Python error)
// where the pair is not a plain member with a str name.
bool add_to_key(std::string *key, PyObject *pair, PyObject *plain_types) {
  Member m;
  Py_ssize_t len;
  const char *name = plain_member(pair, plain_types, &m) && PyUnicode_Check(m.name)
                       ? PyUnicode_AsUTF8AndSize(m.name, &len)
                       : nullptr;
  if (!name) {
    PyErr_Clear();
    return false;
  }
  const at::Tensor &t = *m.tensor;
  const at::IntArrayRef sizes = t.sizes(), strides = t.strides();
  const size_t ndim = sizes.size();
  // Written in place: one resize per member, not an append per field.
  const size_t at = key->size();
  key->resize(at + 4 + static_cast<size_t>(len) + 8 + 2 + 1 + 4 + 16 * ndim);
  char *p = &(*key)[at];
  p = put(p, static_cast<uint32_t>(len));
  std::memcpy(p, name, static_cast<size_t>(len));
  p += len;
  p = put(p, reinterpret_cast<uint64_t>(t.data_ptr()));
  p = put(p, static_cast<int16_t>(t.scalar_type()));
  p = put(p, static_cast<uint8_t>(m.lazy));
  p = put(p, static_cast<uint32_t>(ndim));
  for (int64_t v : sizes) p = put(p, v);
  for (int64_t v : strides) p = put(p, v);
  return true;
}

// set_key(members, plain_types) -> bytes: every field set_items reads of each
// member (its name's UTF-8, address, dtype, lazy bit, shape, strides), laid
// end to end: equal keys are equal item lists, at a fraction of their cost.
// members: a list of (name, tensor) pairs, or a mapping, read through its
// items() without a list of them. None when a member is not plain
// (plain_member), a name is not a str, or items() fails.
PyObject *set_key(PyObject *, PyObject *args) {
  PyObject *members, *plain_types;
  if (!PyArg_ParseTuple(args, "OO!", &members, &PyTuple_Type, &plain_types)) return nullptr;
  std::string key;
  try {
    if (PyList_Check(members)) {
      const Py_ssize_t n = PyList_GET_SIZE(members);
      key.reserve(static_cast<size_t>(n) * 96);
      for (Py_ssize_t i = 0; i < n; i++)
        if (!add_to_key(&key, PyList_GET_ITEM(members, i), plain_types)) Py_RETURN_NONE;
    } else {
      Py_ssize_t n = PyObject_Length(members);
      key.reserve(static_cast<size_t>(n > 0 ? n : 1) * 96);
      PyObject *items = n >= 0 ? PyObject_CallMethod(members, "items", nullptr) : nullptr;
      PyObject *it = items ? PyObject_GetIter(items) : nullptr;
      Py_XDECREF(items);
      bool plain = it != nullptr;
      while (plain) {
        PyObject *pair = PyIter_Next(it); // a dict's items reuse one tuple while no one else holds it
        if (!pair) break;
        plain = add_to_key(&key, pair, plain_types);
        Py_DECREF(pair);
      }
      Py_XDECREF(it);
      if (!plain || PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
      }
    }
  } catch (const std::exception &) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  return PyBytes_FromStringAndSize(key.data(), static_cast<Py_ssize_t>(key.size()));
}

// One received share's tensor: over the capsule's memory, in dtype (a
// torch.dtype of the capsule's element size), as torch.from_dlpack makes it
// without its Python call's parsing and conversion. (tensor, storage key).
PyObject *tensor_of(PyObject *, PyObject *args) {
  PyObject *capsule, *dtype;
  if (!PyArg_ParseTuple(args, "OO", &capsule, &dtype)) return nullptr;
  if (!THPDtype_Check(dtype)) return PyErr_SetString(PyExc_TypeError, "tshare: tensor_of: not a torch.dtype"), nullptr;
  Capsule c;
  if (!open_capsule(capsule, &c)) return nullptr;
  const at::ScalarType type = reinterpret_cast<THPDtype *>(dtype)->scalar_type;
  if (static_cast<int64_t>(c10::elementSize(type)) * 8 != c.tensor->dtype.bits * c.tensor->dtype.lanes)
    return PyErr_Format(PyExc_ValueError, "tshare: tensor_of: %d-bit elements are not %s", c.tensor->dtype.bits,
                        c10::toString(type)),
           nullptr;
  try {
    at::Tensor t = consume_capsule(capsule, c, type);
    PyObject *key = PyLong_FromVoidPtr(t.storage().unsafeGetStorageImpl());
    PyObject *tensor = key ? wrap(t) : nullptr;
    PyObject *out = tensor ? PyTuple_Pack(2, tensor, key) : nullptr;
    Py_XDECREF(tensor);
    Py_XDECREF(key);
    return out;
  } catch (const std::exception &e) {
    PyErr_Format(PyExc_RuntimeError, "tshare: tensor_of: %s", e.what());
    return nullptr;
  }
}

PyMethodDef methods[] = {
  {"tensor_of", tensor_of, METH_VARARGS, "A received share's tensor (tshare/_torch.py)."},
  {"set_key", set_key, METH_VARARGS, "What a kept set is known by (tshare/_sets.py)."},
  {"set_items", set_items, METH_VARARGS, "What a set's send reads of each member (tshare/_sets.py)."},
  {"set_items_cuda", set_items_cuda, METH_VARARGS, "set_items, with CUDA members' fields (tshare/_sets.py)."},
  {"set_tensors", set_tensors, METH_VARARGS, "The tensors of a received set (tshare/_sets.py)."},
  {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_torch_native", "tshare's tensor making, in C++", -1, methods,
                          nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__torch_native(void) {
  PyObject *m = PyModule_Create(&module_def);
  if (m && PyModule_AddStringConstant(m, "torch_version", TORCH_VERSION) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
