#pragma once
#include "moelink/all_to_all.h"
#include "moelink/bootstrap.h"
#include "moelink/config.h"
#include "moelink/errors.h"
#include "moelink/experts.h"
#include "moelink/moe_layer.h"
#include "moelink/types.h"
