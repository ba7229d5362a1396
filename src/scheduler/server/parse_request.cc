#include "scheduler/server/parse_request.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/io/coded_stream.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <climits>
#include <cstdint>

namespace moelink::scheduler {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::io::CodedInputStream;

// Protobuf's own nesting limit (CodedInputStream's default recursion limit).
constexpr int kMaxDepth = 100;

// Well-formed UTF-8 (Unicode table 3-7: no overlong forms, no surrogates,
// nothing above U+10FFFF), which protobuf requires of a proto3 string.
bool valid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    const unsigned c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    unsigned lo = 0x80, hi = 0xBF;  // the second byte's range
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else {
      return false;
    }
    if (n - i < len || p[i + 1] < lo || p[i + 1] > hi) return false;
    for (size_t k = 2; k < len; ++k)
      if ((p[i + k] & 0xC0) != 0x80) return false;
    i += len;
  }
  return true;
}

// Bytes per packed element: 0 for varints, 4 or 8 for fixed widths, -1 for
// types that are never packed.
int packed_width(const FieldDescriptor& f) {
  if (!f.is_repeated() || !f.is_packable()) return -1;
  switch (f.type()) {
    case FieldDescriptor::TYPE_FIXED32:
    case FieldDescriptor::TYPE_SFIXED32:
    case FieldDescriptor::TYPE_FLOAT:
      return 4;
    case FieldDescriptor::TYPE_FIXED64:
    case FieldDescriptor::TYPE_SFIXED64:
    case FieldDescriptor::TYPE_DOUBLE:
      return 8;
    default:
      return 0;
  }
}

class Walker {
 public:
  explicit Walker(std::string_view bytes)
      : in_(reinterpret_cast<const uint8_t*>(bytes.data()), static_cast<int>(bytes.size())) {
    in_.PushLimit(static_cast<int>(bytes.size()));
  }

  // Reads the fields of `type` (null inside an unknown group: every field is
  // unknown) up to the current limit, or up to the end-group tag of field
  // `group` (> 0). `parent` names the enclosing field ("" at the top).
  std::string fields(const Descriptor* type, const std::string& parent, int depth, uint32_t group) {
    while (in_.BytesUntilLimit() > 0) {
      const int pos = in_.CurrentPosition();
      uint64_t tag;
      if (!in_.ReadVarint64(&tag))
        return "byte " + std::to_string(pos) + ": a field tag is cut short or longer than 10 bytes";
      const uint64_t number = tag >> 3;
      const int wire = static_cast<int>(tag & 7);
      if (number == 0 || number > 536870911)  // 2^29 - 1, protobuf's largest field number
        return "byte " + std::to_string(pos) + ": tag " + std::to_string(tag) + " names field " +
               std::to_string(number) + "; field numbers are 1..536870911";
      const FieldDescriptor* f =
          type ? type->FindFieldByNumber(static_cast<int>(number)) : nullptr;
      const std::string what =
          f ? (parent.empty() ? "" : parent + ".") + f->name() + " (field " + std::to_string(number) + ")"
            : "unknown field " + std::to_string(number) + (parent.empty() ? "" : " in " + parent);
      auto fail = [&](const std::string& problem) {
        return what + " at byte " + std::to_string(pos) + ": " + problem;
      };
      switch (wire) {
        case 0: {
          uint64_t v;
          if (!in_.ReadVarint64(&v)) return fail("its varint is cut short or longer than 10 bytes");
          break;
        }
        case 1:
        case 5: {
          const int width = wire == 1 ? 8 : 4;
          const int left = in_.BytesUntilLimit();
          if (left < width)
            return fail("its " + std::to_string(width) + "-byte value is cut short (" +
                        std::to_string(left) + " bytes remain)");
          in_.Skip(width);
          break;
        }
        case 2: {
          uint64_t len;
          if (!in_.ReadVarint64(&len)) return fail("its length is cut short or longer than 10 bytes");
          const int left = in_.BytesUntilLimit();
          if (len > static_cast<uint64_t>(left))
            return fail("its length, " + std::to_string(len) + " bytes, runs past the end of " +
                        (parent.empty() ? "the message" : parent) + " (" + std::to_string(left) +
                        " bytes remain)");
          const auto limit = in_.PushLimit(static_cast<int>(len));
          std::string err;
          const std::string name = f ? (parent.empty() ? "" : parent + ".") + f->name() : what;
          if (f && f->type() == FieldDescriptor::TYPE_MESSAGE) {
            err = depth >= kMaxDepth ? fail("messages nest deeper than " + std::to_string(kMaxDepth))
                                     : fields(f->message_type(), name, depth + 1, 0);
          } else if (f && packed_width(*f) >= 0) {
            err = packed(packed_width(*f), fail);
          } else if (f && f->type() == FieldDescriptor::TYPE_STRING) {
            std::string s;
            in_.ReadString(&s, static_cast<int>(len));
            if (!valid_utf8(s)) err = fail("not valid UTF-8 (a string field holds UTF-8 text)");
          } else {
            in_.Skip(static_cast<int>(len));
          }
          if (!err.empty()) return err;
          in_.PopLimit(limit);
          break;
        }
        case 3: {
          // A group: what protobuf does with a group tag for any field here
          // (none of ours is a group) is skip it as unknown, to its end tag.
          if (depth >= kMaxDepth) return fail("groups nest deeper than " + std::to_string(kMaxDepth));
          std::string err = fields(nullptr, what, depth + 1, static_cast<uint32_t>(number));
          if (!err.empty()) return err;
          break;
        }
        case 4:
          if (number == group) return "";
          return fail(group ? "an end-group tag inside the group of field " + std::to_string(group)
                            : "an end-group tag with no group open");
        default:
          return fail("wire type " + std::to_string(wire) + " (tag " + std::to_string(tag) +
                      "); wire types are 0-5");
      }
    }
    if (group != 0) return parent + ": its group (wire type 3) has no end-group tag";
    return "";
  }

 private:
  template <class Fail>
  std::string packed(int width, const Fail& fail) {
    while (in_.BytesUntilLimit() > 0) {
      if (width == 0) {
        uint64_t v;
        if (!in_.ReadVarint64(&v)) return fail("a packed varint is cut short or longer than 10 bytes");
      } else if (in_.BytesUntilLimit() < width) {
        return fail("its length is not a multiple of its " + std::to_string(width) + "-byte values");
      } else {
        in_.Skip(width);
      }
    }
    return "";
  }

  CodedInputStream in_;
};

}  // namespace

std::string where_parse_fails(const Descriptor& type, std::string_view bytes) {
  if (bytes.size() > static_cast<size_t>(INT_MAX)) return "";
  return Walker(bytes).fields(&type, "", 0, 0);
}

grpc::Status parse_request(const grpc::ByteBuffer& raw, google::protobuf::Message* msg) {
  const std::string& name = msg->GetDescriptor()->name();
  if (!raw.Valid())
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "the call carried no " + name);
  grpc::ByteBuffer copy(raw);  // the reader wants a mutable one; copying shares the slices
  grpc::ProtoBufferReader reader(&copy);
  if (msg->ParseFromZeroCopyStream(&reader)) return grpc::Status::OK;
  // Protobuf says only that it failed: walk the bytes again (contiguous now;
  // this is the rare path) to say where.
  std::string where;
  grpc::Slice slice;
  if (raw.DumpToSingleSlice(&slice).ok())
    where = where_parse_fails(*msg->GetDescriptor(),
                              std::string_view(reinterpret_cast<const char*>(slice.begin()), slice.size()));
  if (where.empty()) where = "not a serialized " + name;
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                      "could not parse " + name + " (" + std::to_string(raw.Length()) + " bytes): " + where);
}

}  // namespace moelink::scheduler
