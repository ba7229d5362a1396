// Parsing a request's bytes in the scheduler's own handlers, so that bytes
// that are not the method's message get INVALID_ARGUMENT naming the message
// and, where it can be told, the field. (gRPC's callback API answers a request
// it cannot parse with a bare UNIMPLEMENTED, which a client cannot tell from
// a missing method; services.h therefore registers every method with a raw
// request.)
#pragma once
#include <google/protobuf/message.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/status.h>

#include <string>
#include <string_view>

namespace moelink::scheduler {

// Parses `raw` into `msg`: OK, or INVALID_ARGUMENT "could not parse
// GenerateRequest (N bytes): ..." with the reason (where_parse_fails).
grpc::Status parse_request(const grpc::ByteBuffer& raw, google::protobuf::Message* msg);

// Where protobuf's wire format breaks in `bytes` read as `type`: the field
// (its name path and number, or "unknown field N"), the byte offset and what
// is wrong (a truncated value, a length beyond the end, a wire type outside
// 0-5, invalid UTF-8 in a string, ...). Empty when the walk finds nothing
// wrong. Protobuf's parser says only "failed", so this walks the bytes again
// with the message's descriptor, accepting what protobuf accepts (unknown
// fields, packed or unpacked repeated scalars, groups).
std::string where_parse_fails(const google::protobuf::Descriptor& type, std::string_view bytes);

}  // namespace moelink::scheduler
