#include "llama-kvq-file.h"

#include "llama-impl.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

llama_kvq_atomic_file::llama_kvq_atomic_file(const char * dest) : dest(dest), part(std::string(dest) + ".part") {}

llama_kvq_atomic_file::~llama_kvq_atomic_file() {
    if (!committed) {
        std::remove(part.c_str());
    }
}

bool llama_kvq_atomic_file::commit() {
    if (std::rename(part.c_str(), dest.c_str()) != 0) {
        LLAMA_LOG_ERROR("%s: cannot rename %s to %s: %s\n", __func__, part.c_str(), dest.c_str(), std::strerror(errno));
        return false;
    }
    committed = true;
    return true;
}
