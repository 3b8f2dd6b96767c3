"""Workload models; importing this package registers them in ``MODELS``."""
from .base_classifier import BaseImageClassifier, LinearClsHead
from .data_preprocessor import TensorBatchPreprocessor
from .gpt import GPTDecoder
from .resnet import ResNet, ResNet50Classifier, ResNetClassifier
from .shufflenet_v2 import ShuffleNetV2, ShuffleNetV2Classifier, ShuffleUnit
from .spos import SPOS_CHOICES, ChoiceLayer, SPOSSupernet

__all__ = [
    'BaseImageClassifier', 'LinearClsHead', 'TensorBatchPreprocessor',
    'GPTDecoder', 'ResNet', 'ResNetClassifier', 'ResNet50Classifier',
    'ShuffleNetV2', 'ShuffleNetV2Classifier', 'ShuffleUnit', 'SPOS_CHOICES',
    'ChoiceLayer', 'SPOSSupernet'
]
